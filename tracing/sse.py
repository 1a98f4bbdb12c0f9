"""Server-sent events from raw bytes, as the ``openai`` client's ``SSEDecoder`` yields them.

The instrumentor decodes a captured stream's events with this parser instead of the client's. The
client's decoder scans every byte with a regular expression and copies each line several times
over. Its cost grows with the bytes: vLLM's token ids and logprobs, which lightspan asks for,
more than double a chat stream, and decoding that extra took longer than everything else lightspan
does for the stream (bench/capture_overhead.py). This parser splits a chunk into lines with
``bytes`` methods and decodes UTF-8 once per chunk.

The interpretation is the WHATWG event-stream one that openai implements, field for field:

- lines end at CR, LF or CRLF (a CRLF may be cut between two chunks);
- a blank line dispatches the event when it has an event name, data, an id (kept across events,
  as the spec says) or a retry;
- ``data`` lines are joined with LF;
- ``event``, ``id`` (unless it holds NUL) and ``retry`` (when ``int()`` takes it) set their
  fields, and lines starting with ``:`` are comments;
- one space after the colon is dropped;
- an event left unterminated when the stream ends is not dispatched;
- bytes that are not UTF-8 raise ``UnicodeDecodeError`` after the events of the lines before them.

``tests/tracing/test_sse.py`` checks this against openai's decoder on generated streams cut into
random chunks.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable

_DATA = itertools.repeat("data: ")           # (an endless argument for map: shared by every call)
_AFTER_DATA = operator.itemgetter(slice(6, None))


class SSEParser:
    """Incremental: :meth:`feed` each chunk of bytes (it returns the events completed, built by
    ``make_event(event, data, id, retry)``; with ``make_event`` None, their data alone), :meth:`finish` at the end. After either, call
    :meth:`check` once the events returned have been handed on: it raises what the bytes held."""

    def __init__(self, make_event: Callable):
        self._make = make_event
        self._pending: list[bytes] = []  # the unterminated line so far
        self._skip_lf = False  # the last chunk ended with a CR: an LF starting the next ends no line
        self._event: str | None = None
        self._data: list[str] = []
        self._id: str | None = None
        self._retry: int | None = None
        self.error: UnicodeDecodeError | None = None  # for check(), once the events returned are used

    def feed(self, chunk: bytes) -> list:
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[0] == 10:
                chunk = chunk[1:]
        if b"\n" not in chunk and b"\r" not in chunk:
            self._pending.append(chunk)
            return []
        if self._pending:
            self._pending.append(chunk)
            chunk = b"".join(self._pending)
        if b"\r" in chunk:
            self._skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        cut = chunk.rfind(b"\n")
        rest = chunk[cut + 1:]
        self._pending = [rest] if rest else []
        return self._lines(chunk[:cut])

    def check(self) -> None:
        """Raise the error of bytes that were not UTF-8, if a chunk held any."""
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        """The end of the stream: an unterminated last line dispatches nothing. It is still
        decoded, so that bytes which are not UTF-8 raise as they do in openai's decoder."""
        rest = b"".join(self._pending)
        self._pending = []
        try:
            rest.decode("utf-8")
        except UnicodeDecodeError as e:
            self.error = e

    def _lines(self, block: bytes) -> list:
        """The events of complete lines (LF-separated, the last one's LF cut off)."""
        try:
            lines = block.decode("utf-8").split("\n")
        except UnicodeDecodeError:
            return self._general(block, None)
        # the usual block (an OpenAI-style stream as it is sent): per event, one ``data: …`` line and
        # a blank one, no event, id or retry set or pending; its events read in C, as the loop reads them
        if (len(lines) % 2 == 0 and not any(lines[1::2]) and all(map(str.startswith, lines[::2], _DATA))
                and not self._data and self._event is None and self._id is None and self._retry is None):
            data = map(_AFTER_DATA, lines[::2])
            make = self._make
            return list(data) if make is None else [make(None, d, None, None) for d in data]
        return self._general(block, lines)

    def _general(self, block: bytes, lines: list | None) -> list:
        """:meth:`_lines`, line by line (``lines``: the block's, None when it is not UTF-8)."""
        if lines is None:
            lines = []
            for raw in block.split(b"\n"):  # the lines before the bad one still count
                try:
                    lines.append(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    self.error = e
                    break
        events = []
        data = self._data
        for line in lines:
            if line.startswith("data:"):  # nearly every line of an OpenAI-style stream
                data.append(line[6:] if line.startswith(" ", 5) else line[5:])
            elif not line:
                if data or self._event or self._id or self._retry is not None:
                    make = self._make
                    events.append("\n".join(data) if make is None else make(self._event, "\n".join(data), self._id,
                                                                             self._retry))
                    self._event, self._retry = None, None
                    data = self._data = []
            elif line[0] != ":":
                name, _, value = line.partition(":")
                if value.startswith(" "):
                    value = value[1:]
                if name == "data":
                    data.append(value)
                elif name == "event":
                    self._event = value
                elif name == "id":
                    if "\0" not in value:
                        self._id = value
                elif name == "retry":
                    try:
                        self._retry = int(value)
                    except (TypeError, ValueError):
                        pass
        return events
