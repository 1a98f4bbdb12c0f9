"""The straight line of the common streamed Anthropic call: its stream read in one loop and
recorded in one step, as the floor of bench/capture_floor_converted.py reads it.

A streamed Anthropic Messages call of the common shape (:func:`.protocols.anthropic_common.common_chat`
with ``stream: true``) is prepared as the plain one is (:func:`.straight.prepare`, the span picked
or awaited alike). When ``post`` hands back the client's ``Stream`` with its own SSE decoder, not
yet iterated, :meth:`StraightStream.tap` makes the call itself the stream's decoder, and
:meth:`StraightStream.iter_bytes` reads the chat chunks vLLM sends, read by read
(:class:`~.sse.SSEParser`), into the events the general path's decoder gives
(:class:`~.streams.ConvertedDecoder` over :class:`~.protocols.anthropic_common.SimpleCapture`):
the usual stream — a first chunk with the prompt's ids, one text token a chunk with its id and
logprob, a finish reason, the usage chunk, ``[DONE]`` — is read in one loop (:meth:`_read`: the
usual token in one step of it, any other of these chunks in :meth:`_other`), and at ``[DONE]`` the
span gets every attribute the general path's record sets, in one ``set_attributes``
(:meth:`.straight.Straight.record`), the report counted.

Anything else goes the general way, with a defined hand-over: before the stream is tapped (a raw
response, another decoder, an iterated stream), :meth:`.straight.Straight.general` makes the call's
general :class:`~.call.Call`; once it is, at the first chunk the straight line does not read (a
reasoning or tool-call delta, another choice, a token without its id or one logprob, data that is
not a chunk, a chunk after the finish reason but the usage, a stream that ends before ``[DONE]``
or is left), :meth:`StraightStream.general` makes that ``Call`` with its capture as the chunks read
so far left it (the capture's ids, logprobs, prompt, model and count; the message stream's block,
its text deltas, its finish and stop reasons), and a :class:`~.streams.ConvertedDecoder` of it reads
the rest of the stream. tests/tracing/test_straight_stream.py holds the two paths equal.
"""

from __future__ import annotations

import sys
import time
from array import array
from itertools import takewhile
from operator import length_hint, methodcaller
from struct import pack

import orjson

from lightspan.tracing import semconv
from lightspan.tracing.protocols.anthropic_convert import stop_reason, usage
from lightspan.tracing.protocols.chat import _Choice
from lightspan.tracing.report import CAPTURED
from lightspan.tracing.sse import SSEParser
from lightspan.tracing.straight import _OUTPUTS, _REASONS, _TEMPERATURE, Straight
from lightspan.tracing.streams import ConvertedDecoder

_IS_CHUNK = methodcaller("startswith", "{")   # (a data that may be a chat chunk: ConvertedDecoder's test)
_SWAP = sys.byteorder != "little"             # (``semconv.encode_floats``: little-endian float32)
_PROMPT, _IDS, _LOGPROBS, _STATUS = (semconv.PROMPT_TOKEN_IDS, semconv.COMPLETION_TOKEN_IDS,
                                     semconv.COMPLETION_LOGPROBS, semconv.CAPTURE_STATUS)
_loads = orjson.loads


class StraightStream(Straight):
    """A streamed call on the straight line (module docstring), and its stream's decoder.

    ``phase``: 0 before the first chunk, 1 after it (no block open), 2 in the text block, 3 after
    the finish reason, 4 after the usage chunk (the block stopped), 5 after ``[DONE]``."""

    stream = converted = True
    output = None   # (``instrumentor._read`` of an error answer's JSON reads it as the general call's)
    phase = fed = 0
    ended = False   # (recorded, or the general path's decoder ended it)
    decoder = inner = None   # the general path's decoder once it reads on; the client's own SSE decoder
    prompt = served = finish = stop = stop_reason = choice_finish = None

    def tap(self, resp) -> bool:
        """``streams.tap`` of the client's stream ``resp`` with this call as its decoder, the span's
        status ``stream_incomplete`` until it ends (``Call.set_status``); False, nothing done, for
        anything but a stream not yet iterated with the client's own decoder on a live span."""
        state = getattr(resp, "__dict__", None)
        if type(state) is not dict:
            return False
        inner, span = state.get("_decoder"), self.span
        if (type(inner) is not self.model.line.decoder or "_iterator" in state
                or (self.adopted and not span.is_recording())):   # (``Call._live``: an adopted span ended)
            return False
        state["_decoder"], self.inner = self, inner
        self.ids, self.logprobs, self.texts = [], [], []
        if span.is_recording():
            span.set_attribute(_STATUS, "stream_incomplete")
        return True

    def iter_bytes(self, iterator):
        """The stream's events (``ConvertedDecoder.iter_bytes``): each read's chunks read straight,
        from the first it does not read on by the general path's decoder (:meth:`_decoder`)."""
        parser = SSEParser(None)
        try:
            for raw in iterator:
                decoder = self.decoder
                if decoder is None:
                    datas = parser.feed(raw)
                    out: list = []
                    at = self._read(datas, out) if datas else None
                    if at is not None:   # (the general path reads on from there)
                        self._decoder().batched(datas, at, out)
                else:
                    out = decoder._events(parser, raw)
                yield from out
                if parser.error is not None:   # (``parser.check()``)
                    raise parser.error
            parser.finish()
            if parser.error is not None:
                raise parser.error
            if not self.ended:
                self.end(True)
        finally:
            if not self.ended:
                self.end(False)

    def end(self, complete: bool) -> None:
        """``ConvertedDecoder.end``: the stream ended before the straight line recorded it (or was left)."""
        self._decoder().end(complete)
        self.ended = True

    def _read(self, datas: list, out: list) -> int | None:
        """The events of one read's data (``datas``) appended to ``out``: None when the straight line
        read it all, else the index of the first data it does not read (nothing of it read)."""
        head = datas if all(map(_IS_CHUNK, datas)) else list(takewhile(_IS_CHUNK, datas))   # (in C) the chunks
        make, it, stop = self.model.line.event, iter(head), len(head)
        fast = self.phase == 2
        if fast:
            ids_add, lp_add, texts_add = self.ids.extend, self.logprobs.append, self.texts.append
        for data in it:
            try:
                chunk = _loads(data)
            except orjson.JSONDecodeError:   # (what json may read: the general path's ``loads``)
                return self._at(stop - length_hint(it) - 1)
            if fast:   # the usual token: one text token of choice 0, its id and its logprob
                try:   # (subscripts: of JSON data, only a dict whose choices are a list of one dict gets past them)
                    (choice,) = chunk["choices"]
                    delta = choice["delta"]
                    text = delta["content"]
                    ids = choice["token_ids"]
                    (entry,) = choice["logprobs"]["content"]
                    logprob = entry["logprob"]
                except (KeyError, TypeError, ValueError):
                    text = None
                # (as ``AnthropicCapture.batch``'s; a later chunk's prompt ids change nothing: the prompt is read)
                if (type(text) is str and text and type(ids) is list and choice.get("finish_reason") is None
                        and not choice.get("index")
                        and (len(delta) == 1 or (delta.get("reasoning") is None and not delta.get("tool_calls")))):
                    ids_add(ids)
                    lp_add(logprob)
                    texts_add(text)
                    out.append(make("content_block_delta", {"type": "content_block_delta", "delta": {
                        "type": "text_delta", "text": text}, "index": 0}))
                    continue
            if not self._other(chunk, out):
                return self._at(stop - length_hint(it) - 1)
            fast = self.phase == 2
            if fast:
                ids_add, lp_add, texts_add = self.ids.extend, self.logprobs.append, self.texts.append
        self.fed += stop
        if stop == len(datas):
            return None
        if self.phase == 4 and datas[stop].startswith("[DONE]"):   # (``AnthropicCapture.end``, then the record)
            self.phase = 5
            out.append(make("message_stop", {"type": "message_stop"}))
            self._record()
            stop += 1
            return stop if stop < len(datas) else None
        return stop

    def _at(self, at: int) -> int:
        """:meth:`_read` hands the read over at ``at``: the chunks before it were read."""
        self.fed += at
        return at

    def _other(self, chunk, out: list) -> bool:
        """A chunk the usual token's step does not read, read as ``AnthropicCapture.events`` reads it
        (its capture's ``add_json``, its stream's ``feed``): the first chunk, a token that opens the
        text block, a token of no text, the finish reason, the usage chunk. False, nothing read, for
        any other (or one that would raise: the general path raises it)."""
        phase, make = self.phase, self.model.line.event
        try:
            choices = chunk["choices"]
            if phase == 0:   # the first: its prompt ids and the message's start (its delta is not read)
                (choice,) = choices
                prompt, model = chunk["prompt_token_ids"], chunk["model"]
                if (type(choice) is not dict or choice.get("index") or choice.get("finish_reason")
                        or choice.get("token_ids") is not None or choice.get("logprobs") is not None
                        or type(prompt) is not list or type(model) is not str):
                    return False
                packed = pack(f"<{len(prompt)}i", *prompt)   # (``semconv.encode_ids``)
                u = chunk.get("usage")   # (``usage`` of one without cached tokens written out: ``- 0``, as its
                # ``- read - created``, makes a bool an int)
                u = {"input_tokens": max(0, (u.get("prompt_tokens") or 0) - 0), "cache_creation_input_tokens": 0,
                     "cache_read_input_tokens": 0, "output_tokens": u.get("completion_tokens") or 0} if (
                    type(u) is dict and not u.get("prompt_tokens_details")) else usage(u)
                start = {"type": "message_start", "message": {
                    "id": chunk.get("id") or f"msg_{int(time.time() * 1000)}", "type": "message", "role": "assistant",
                    "content": [], "model": model, "stop_reason": None, "stop_sequence": None, "usage": u}}
                self.prompt, self.n, self.served, self.phase = packed, len(prompt), model, 1
                out.append(make("message_start", start))
                return True
            if type(choices) is list and not choices:   # the usage: the block's stop and the message's delta
                if phase != 2 and phase != 3:
                    return False
                reason, sequence = stop_reason(self.finish or "stop", self.stop, False, False)
                u = chunk.get("usage")   # (as the first chunk's)
                u = {"input_tokens": max(0, (u.get("prompt_tokens") or 0) - 0), "cache_creation_input_tokens": 0,
                     "cache_read_input_tokens": 0, "output_tokens": u.get("completion_tokens") or 0} if (
                    type(u) is dict and not u.get("prompt_tokens_details")) else usage(u)
                delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": u}
                self.stop_reason, self.phase = reason, 4
                out += [make("content_block_stop", {"type": "content_block_stop", "index": 0}),
                        make("message_delta", delta)]
                return True
            (choice,) = choices
            delta, ids = choice["delta"], choice["token_ids"]
            (entry,) = choice["logprobs"]["content"]
            logprob, text, finish = entry["logprob"], delta.get("content"), choice.get("finish_reason")
            if (phase > 2 or type(ids) is not list or choice.get("index") or delta.get("reasoning")
                    or delta.get("tool_calls") or (text is not None and type(text) is not str)
                    or (phase == 1 and finish is not None and not text)):   # (an answer of no text)
                return False
        except Exception:
            return False
        # a token (``add_json``: its id and logprob; ``feed``: its text, the block opened for the first)
        if text and phase == 1:
            out.append(make("content_block_start", {"type": "content_block_start",
                                                    "content_block": {"type": "text", "text": ""}, "index": 0}))
            self.phase = 2
        if text:
            self.texts.append(text)
            out.append(make("content_block_delta", {"type": "content_block_delta", "delta": {
                "type": "text_delta", "text": text}, "index": 0}))
        if finish is not None:
            self.finish, self.stop, self.phase = finish, choice.get("stop_reason"), 3
            if finish:
                self.choice_finish = finish
        self.ids.extend(ids)
        self.logprobs.append(logprob)
        return True

    def _record(self) -> None:
        """``Call.finish(True)`` of the stream read straight (``Call._record`` with ``SimpleCapture``'s
        attributes): the span-free attributes made here, :meth:`.straight.Straight.record` the rest;
        an answer with no ids, or ids and logprobs of different lengths or types, the general way."""
        ids, logprobs = self.ids, self.logprobs
        try:
            if not ids or len(ids) != len(logprobs):
                raise ValueError
            floats = array("f", logprobs)   # (``semconv.encode_floats``)
            if _SWAP:
                floats.byteswap()
            attrs = {_PROMPT: self.prompt, _IDS: (pack(f"<{len(ids)}i", *ids),), _LOGPROBS: (floats.tobytes(),),
                     _STATUS: CAPTURED}
        except Exception:   # (the general record says what it is)
            self.end(True)
            return
        self.ended = True
        temperature = self.chat.get("temperature")
        if temperature is not None:
            attrs[_TEMPERATURE] = float(temperature)
        reason = self.stop_reason or self.choice_finish
        if reason:
            attrs[_REASONS] = (reason,)
        if self.model.content:   # (``anthropic_stream_output`` of one text block; ``messages.dumps`` of text)
            text = "".join(self.texts)
            attrs[_OUTPUTS] = orjson.dumps([{"role": "assistant", "parts": [{"type": "text", "content": text}]
                                             if text else [], "finish_reason": self.stop_reason}]).decode()
        self.record(attrs, self.served, self.n, len(ids))
        if self.owned:
            self.span.end()

    def general(self):
        """:meth:`.straight.Straight.general`, its capture as the chunks read so far left it."""
        if self.call is not None:
            return self.call
        call = super().general()
        if self.phase:
            cap = call.cap
            chat, stream = cap.chat, cap.stream
            chat.fed, chat.parsed, chat.prompt, chat.prompt_tokens, chat.model = self.fed, True, self.prompt, self.n, \
                self.served
            c = chat.choices[0] = _Choice()
            c.ids, c.logprobs, c.finish_reason = self.ids, self.logprobs, self.choice_finish
            stream.first, stream.finish_reason, stream.stop = False, self.finish, self.stop
            if self.phase >= 2:
                stream.blocks.append(({"type": "text", "text": ""}, [{"type": "text_delta", "text": text}
                                                                      for text in self.texts]))
                if self.phase < 4:
                    stream.block, stream.index = "text", 0
                else:
                    stream.next_index = 1
            cap.stop_reason, cap.done = self.stop_reason, self.phase == 5
        call.ended = self.ended
        return call

    def _decoder(self) -> ConvertedDecoder:
        """The general path's decoder of the call (made once), to read the stream on."""
        decoder = self.decoder
        if decoder is None:
            # (a converted stream's decoder reads through ``read`` only with output messages to
            # gather, which a SimpleCapture's stream has not: ``read`` is not needed)
            decoder = self.decoder = ConvertedDecoder(self.inner, self.general(), None, self.model.line.event, True)
            decoder.ended = self.ended
        return decoder
