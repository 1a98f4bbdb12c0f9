"""Captured streams: the client's own stream object, its server-sent-event decoder replaced.

openai and anthropic build a stream's events with ``Stream._decoder`` (lazily, when the caller
starts reading). lightspan puts a :class:`CapturedDecoder` there: the stream object the caller
holds is the same one (isinstance checks, ``with`` blocks, ``.response`` and ``.close()`` are
untouched), and its events are those the client's decoder would give, parsed from the bytes by
:class:`~lightspan.tracing.sse.SSEParser` (checked against openai's decoder in
tests/tracing/test_sse.py). Each event's ``json()`` decodes its data with lightspan and feeds the
call's capture (``read``, from the instrumentor). A converted call's stream (Responses, Anthropic
Messages) is vLLM's chat completion stream: its decoder hands the client the events its protocol's
capture makes of each chunk instead (``events``, ``end``).

The capture is recorded when the stream's end is handed on (``[DONE]``, or the end of the bytes):
every event before it has been decoded by then, and the OpenAI instrumentation ends its span only
after the stream ends, so the attributes land first. A stream left before its end keeps
``capture.status=stream_incomplete``. A decoder of the client's own (``_make_sse_decoder``
overridden) is kept, and its events are read as they pass.
"""

from __future__ import annotations

import functools
from itertools import starmap

import orjson

from lightspan.tracing.clients import Client
from lightspan.tracing.protocols.base import loads
from lightspan.tracing.protocols.chat import EMPTY_DELTA, only_for_capture
from lightspan.tracing.sse import SSEParser


class CapturedDecoder:
    """Replaces ``Stream._decoder`` for one captured call; ``call.finish(complete)`` records it."""

    def __init__(self, inner, call, read, event_type: type, own: bool):
        self.inner, self.call, self.read, self.event_type, self.own = inner, call, read, event_type, own
        self.ended = False
        self.drops = bool(getattr(call.cap, "drops_empty_chunks", False))

    passes = True   # whether each event goes through _pass (a converted stream's events all go out)

    def _make(self, name, data, id, retry):
        return self.event_type(self.call, self.read, name, data, id, retry)

    def _pass(self, sse) -> bool:
        """Before an event goes out: the capture is recorded as ``[DONE]`` goes; an event of the
        client's own decoder is read into the capture (the client decodes its own copy). True when
        the event does not go out: a chunk vLLM sent only because lightspan asked for the ids
        (:func:`~lightspan.tracing.protocols.chat.only_for_capture`), read into the capture here."""
        data = sse.data
        if data.startswith("[DONE]"):
            self.end(True)
            return False
        maybe = self.drops and EMPTY_DELTA in data
        if not self.own:
            decoded = self.read(self.call, data)
            return maybe and type(decoded) is dict and only_for_capture(decoded)
        if maybe:
            decoded = self.read(self.call, data)
            if type(decoded) is dict and only_for_capture(decoded):
                return True
            sse._lightspan = (decoded, None)   # read: its json() is this
        return False

    def end(self, complete: bool) -> None:
        if not self.ended:
            self.ended = True
            self.call.finish(complete)

    def _events(self, parser: SSEParser, chunk: bytes):
        return parser.feed(chunk)

    def iter_bytes(self, iterator):
        try:
            if self.own:
                parser = SSEParser(self._make)
                for chunk in iterator:
                    if self.passes:
                        for sse in self._events(parser, chunk):
                            if not self._pass(sse):
                                yield sse
                    else:
                        yield from self._events(parser, chunk)
                    parser.check()
                parser.finish()
                parser.check()
            else:
                for sse in self.inner.iter_bytes(iterator):
                    if not self.passes or not self._pass(sse):
                        yield sse
            self.end(True)
        finally:
            self.end(False)

    async def aiter_bytes(self, iterator):
        try:
            if self.own:
                parser = SSEParser(self._make)
                async for chunk in iterator:
                    for sse in self._events(parser, chunk):
                        if not self.passes or not self._pass(sse):
                            yield sse
                    parser.check()
                parser.finish()
                parser.check()
            else:
                async for sse in self.inner.aiter_bytes(iterator):
                    if not self.passes or not self._pass(sse):
                        yield sse
            self.end(True)
        finally:
            self.end(False)


class ConvertedDecoder(CapturedDecoder):
    """The decoder of a converted call: vLLM's chat chunks in, the caller's protocol's events out
    (``event_type``: :func:`converted_event_type`'s)."""

    passes = False
    _make = None   # of a chat chunk only the data is read: the parser builds no event for it

    def _events(self, parser: SSEParser, chunk: bytes):
        out = []
        make, call = self.event_type, self.call
        cap, read = call.cap, (self.read if call.output is not None else None)
        if read is None and getattr(cap, "batch", None) is not None:   # (AnthropicCapture.batch)
            return self.batched(parser.feed(chunk), 0, out)
        for data in parser.feed(chunk):
            if data.startswith("{"):
                # (a converted stream's chunks are read by its capture's ``events``: without output
                # messages to gather, ``read`` would only decode them)
                if read is None:
                    try:   # (loads, inlined: this runs per token)
                        chunk_json = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        chunk_json = loads(data)
                else:
                    chunk_json = read(call, data)
                if type(chunk_json) is dict:
                    out += starmap(make, cap.events(chunk_json))
            elif data.startswith("[DONE]"):
                out += starmap(make, cap.end())
                self.end(True)
        return out


    def batched(self, datas: list, i: int, out: list) -> list:
        """``out`` with the events of one read's data from ``datas[i]`` on, read by the capture's
        ``batch`` (its chunks in one loop), the call recorded at ``[DONE]``. (Also where the streamed
        call's straight line hands a read over: :mod:`.straight_stream`.)"""
        batch, make, n = self.call.cap.batch, self.event_type, len(datas)
        while i < n:
            i = batch(datas, i, make, out)
            if datas[i - 1].startswith("[DONE]"):
                self.end(True)
        return out


@functools.lru_cache(maxsize=4)
def event_type(client: Client) -> type:
    """The client library's ``ServerSentEvent``, whose ``json()`` decodes with lightspan and feeds
    the call."""
    class CapturedEvent(client.types().sse_event):
        def __init__(self, call, read, event, data, id, retry):
            super().__init__(event=event, data=data, id=id, retry=retry)
            self._lightspan = (call, read)

        def json(self):
            call, read = self._lightspan
            if read is None:   # (read already, by CapturedDecoder._pass: ``call`` is what it decoded)
                return call
            return read(call, self._data)

    return CapturedEvent


@functools.lru_cache(maxsize=4)
def converted_event_type(client: Client) -> type:
    """The client library's ``ServerSentEvent`` for an event converted from a chat chunk: its
    ``json()`` is the converted event, its text is made when it is read."""
    class ConvertedEvent(client.types().sse_event):
        def __init__(self, event, decoded):
            super().__init__(event=event)
            self._decoded = decoded

        @property
        def data(self) -> str:
            if not self._data:
                self._data = orjson.dumps(self._decoded).decode()
            return self._data

        def json(self):
            return self._decoded

    return ConvertedEvent


def tap(stream, call, read) -> bool:
    """Put a captured decoder on ``stream`` (an openai or anthropic ``Stream``); False when the
    object is not a stream of parsed events (``with_streaming_response`` before ``parse()``)."""
    state = getattr(stream, "__dict__", {})
    decoder = state.get("_decoder")
    # openai makes the events' generator in __init__ and it reads ``_decoder`` once iterated;
    # anthropic makes it, on a copy of the stream, at first use: tap before that
    if decoder is None or call.client.eager_stream != ("_iterator" in state):
        return False
    own = type(decoder) is call.client.types().sse_decoder
    kind = ConvertedDecoder if call.converted else CapturedDecoder
    if call.converted and not own:
        return False   # a decoder of the client's own cannot be handed converted events
    events = converted_event_type if call.converted else event_type
    stream._decoder = kind(decoder, call, read, events(call.client), own)
    return True
