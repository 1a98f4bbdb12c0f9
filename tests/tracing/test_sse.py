"""lightspan's SSE parser yields what openai's own decoder yields, for any stream cut anywhere."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai._streaming import ServerSentEvent, SSEDecoder

from lightspan.tracing.sse import SSEParser


def _key(sse) -> tuple:
    return sse.event, sse.data, sse.id, sse.retry


def _theirs(chunks: list[bytes]) -> tuple[list, str | None]:
    out = []
    try:
        for sse in SSEDecoder().iter_bytes(iter(chunks)):
            out.append(_key(sse))
    except UnicodeDecodeError:
        return out, "UnicodeDecodeError"
    return out, None


def _ours(chunks: list[bytes]) -> tuple[list, str | None]:
    parser = SSEParser(lambda event, data, id, retry: ServerSentEvent(event=event, data=data, id=id, retry=retry))
    out = []
    try:
        for chunk in chunks:
            out += [_key(e) for e in parser.feed(chunk)]
            parser.check()
        parser.finish()
        parser.check()
    except UnicodeDecodeError:
        return out, "UnicodeDecodeError"
    return out, None


_NAMES = st.sampled_from(["data", "event", "id", "retry", "", "foo", "dat", "data ", "DATA"])
_VALUES = st.one_of(
    st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=12),
    st.sampled_from(["", " ", "  x", "12", " 7", "-3", "1_0", "x\0y", "[DONE]", '{"choices": []}', ":", " : "]))
_LINE = st.one_of(
    st.tuples(_NAMES, st.sampled_from([":", ": ", ":  ", ""]), _VALUES).map(lambda t: "".join(t)),
    st.just(""), _VALUES.map(lambda v: ":" + v))
_EOL = st.sampled_from(["\n", "\r", "\r\n"])


@st.composite
def _streams(draw) -> list[bytes]:
    lines = draw(st.lists(st.tuples(_LINE, _EOL), max_size=25))
    data = "".join(line + eol for line, eol in lines)
    if draw(st.booleans()):
        data += draw(_LINE)  # an unterminated last line
    raw = bytearray(data.encode("utf-8"))
    if raw and draw(st.integers(0, 9)) == 0:  # now and then a byte that is not UTF-8
        raw.insert(draw(st.integers(0, len(raw))), draw(st.sampled_from([0xFF, 0xC3, 0x80])))
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    bounds = [0, *cuts, len(raw)]
    return [bytes(raw[a:b]) for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_streams())
def test_same_events_as_openai_for_any_stream_and_cuts(chunks):
    assert _ours(chunks) == _theirs(chunks)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_streams())
def test_without_an_event_maker_the_events_data_alone(chunks):
    """(A converted stream's parser: ``make_event`` None hands on each event's data.)"""
    parser, out = SSEParser(None), []
    for chunk in chunks:
        out += parser.feed(chunk)
    events, error = _ours(chunks)
    data = [d for _event, d, _id, _retry in events]
    assert (out[:len(data)] if error else out) == data   # (ours stops at the bytes that are not UTF-8)


@st.composite
def _data_streams(draw) -> list[bytes]:
    """Mostly the usual events (``data: …`` and a blank line, as vLLM sends them), now and then a
    line that sets a field or opens an event of two lines; each event whole in its chunk, or cut."""
    events = draw(st.lists(st.one_of(
        _VALUES.map(lambda v: f"data: {v}\n\n"), _VALUES.map(lambda v: f"data:{v}\n\n"),
        st.sampled_from(["id: 7\n", "event: x\n", "retry: 5\n", ": keep\n", "data: a\n", "\n", "data: b\r\n\r\n"])),
        max_size=30))
    raw = "".join(events).encode("utf-8")
    if draw(st.booleans()):   # one chunk per event, as a server flushes them
        return [e.encode("utf-8") for e in events]
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    bounds = [0, *cuts, len(raw)]
    return [raw[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_data_streams())
def test_blocks_of_data_lines_read_at_once_as_line_by_line(chunks):
    """(The parser reads a block of ``data: …`` lines and blank ones in C: the same events, with and
    without an event maker, whatever came before.)"""
    assert _ours(chunks) == _theirs(chunks)
    parser, out = SSEParser(None), []
    for chunk in chunks:
        out += parser.feed(chunk)
    assert out == [d for _event, d, _id, _retry in _ours(chunks)[0]]


def test_vllm_stream_with_crlf_cut_between_chunks_and_a_lasting_id():
    body = (b'data: {"a": 1}\r\n\r\nid: 7\r\ndata: x\r\ndata:  y\r\n\r\n: keep-alive\r\n\r\n'
            b"event: done\rdata: [DONE]\r\r")
    whole = _ours([body])
    assert whole == _theirs([body])
    # the id lasts, so the blank line after the keep-alive comment dispatches an empty event
    assert whole == ([(None, '{"a": 1}', None, None), (None, "x\n y", "7", None), (None, "", "7", None),
                      ("done", "[DONE]", "7", None)], None)
    for cut in range(len(body) + 1):  # every cut, the CRs and LFs of a CRLF apart included
        assert _ours([body[:cut], body[cut:]]) == whole, cut
    byte_by_byte = [body[i:i + 1] for i in range(len(body))]
    assert _ours(byte_by_byte) == whole


def test_bytes_not_utf8_raise_after_the_events_before_them():
    chunks = [b"data: a\n\ndata: \xff\n\ndata: b\n\n"]
    assert _ours(chunks) == _theirs(chunks) == ([(None, "a", None, None)], "UnicodeDecodeError")
