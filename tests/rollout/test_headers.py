"""The gateway's header-to-attribute mapping: ``x-lightspan-agent`` names the call's agent."""

from __future__ import annotations

from http.client import HTTPMessage

from lightspan.rollout.headers import MAX_AGENT_NAME, header_attributes
from lightspan.tracing import semconv


def test_the_agent_header_becomes_the_calls_agent_name_in_any_case():
    assert semconv.AGENT_HEADER == "x-lightspan-agent"
    assert header_attributes({"X-Lightspan-Agent": " supervisor "}) == {semconv.GEN_AI_AGENT_NAME: "supervisor"}
    assert header_attributes([("content-type", "application/json"), ("x-lightspan-agent", "écrivain")]) == {
        semconv.GEN_AI_AGENT_NAME: "écrivain"}
    # the stdlib's header object, as the gateway's handler holds it
    message = HTTPMessage()
    message["X-LIGHTSPAN-AGENT"] = "sql_writer"
    assert header_attributes(message.items()) == {semconv.GEN_AI_AGENT_NAME: "sql_writer"}


def test_no_header_or_one_that_cannot_be_a_name_sets_nothing():
    assert header_attributes({"authorization": "Bearer x"}) == {}
    for bad in ("", "   ", "a\nb", "tab\there", "x" * (MAX_AGENT_NAME + 1)):
        assert header_attributes({"x-lightspan-agent": bad}) == {}, bad
    # a bad first value does not hide a good second one
    assert header_attributes([("x-lightspan-agent", ""), ("x-lightspan-agent", "ok")]) == {
        semconv.GEN_AI_AGENT_NAME: "ok"}


def test_a_header_sent_twice_is_its_first_value_not_both_joined():
    """Two ``x-lightspan-agent`` headers were recorded as "first, second" (the values joined, as a
    mapping of headers holds them); the docs say the first wins, for the rollout headers too."""
    from lightspan.rollout.paths import call_attributes

    pairs = [("X-Lightspan-Agent", "first"), ("x-lightspan-agent", "second"), ("X-Lightspan-Rollout-Id", "r1"),
             ("x-lightspan-rollout-id", "r2"), ("x-lightspan-task-id", ""), ("x-lightspan-task-id", "t7")]
    assert call_attributes({semconv.ROLLOUT_ID: "from-path"}, pairs) == {
        semconv.GEN_AI_AGENT_NAME: "first", semconv.ROLLOUT_ID: "r1", semconv.TASK_ID: "t7"}
