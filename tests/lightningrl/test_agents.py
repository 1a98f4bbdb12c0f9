"""Attributing LLM calls to agents: nearest enclosing agent span, then the call's own
gen_ai.agent.name, then service.name; ``agent_match`` selects what trains."""

import json

import pytest

from .helpers import build, call, reward, rows_by_id, runner, span, write


def _two_agent_rollout(rid, *, writer_reward=1.0, kind="gen_ai"):
    """writer → checker → writer, each call under its agent's span, no agent name on the calls."""
    trace = f"{abs(hash(rid)) % 16**32:032x}"
    root = span(rid, "lightspan.rollout", 0, 100, trace=trace)
    rows = [root]

    def agent_span(name, start, end):
        if kind == "gen_ai":
            cols = dict(operation_name="invoke_agent")
            label = f"invoke_agent {name}"
        else:   # traceloop's LangChain/LangGraph instrumentation
            cols = dict(attributes=[("traceloop.span.kind", json.dumps("agent")),
                                    ("traceloop.entity.name", json.dumps(name))])
            label = f"{name}.agent"
        return span(rid, label, start, end, trace=trace, parent_span_id=root["span_id"], **cols)

    for i, name in enumerate(("writer", "checker", "writer")):
        a = agent_span(name, 20 * i, 20 * i + 15)
        # a task span between the agent and its call: the walk goes up more than one level
        t = span(rid, "step.task", 20 * i + 1, 20 * i + 14, trace=trace, parent_span_id=a["span_id"])
        c = call(rid, 20 * i + 2, 20 * i + 12, agent=None, trace=trace, parent_span_id=t["span_id"])
        rows += [a, t, c]
    rows += [reward(rid, 70, writer_reward, trace=trace, parent_span_id=root["span_id"]),
             runner(rid, 80, trace=trace)]
    return rows


@pytest.mark.parametrize("kind", ["gen_ai", "traceloop"])
def test_calls_belong_to_their_nearest_enclosing_agent_span(tmp_path, kind):
    write(tmp_path, _two_agent_rollout("r1", kind=kind) + _two_agent_rollout("r2", writer_reward=0.0, kind=kind))
    table, metrics = build(tmp_path)
    assert sorted(set(table.column("agent_name").to_pylist())) == ["checker", "writer"]
    assert metrics["transitions/calls"] == 6

    table, metrics = build(tmp_path, agent_match="^writer$")
    assert set(table.column("agent_name").to_pylist()) == {"writer"}
    assert metrics["transitions/calls"] == 4                       # two writer calls in each rollout
    assert metrics["transitions/dropped_calls/agent_mismatch"] == 2
    assert sorted(table.column("call_index").to_pylist()) == [0, 0, 1, 1]   # index among the writer's calls


def test_an_agent_name_on_the_call_itself_wins_over_an_enclosing_agent(tmp_path):
    rows = _two_agent_rollout("r1") + _two_agent_rollout("r2", writer_reward=0.0)
    for r in rows:      # the checker's calls name their own agent
        if r["operation_name"] == "chat" and r["start_time_unix_nano"] % 100 == 22:
            r["agent_name"] = "critic"
    write(tmp_path, rows)
    table, _ = build(tmp_path, agent_match="critic")
    assert table.num_rows == 2 and set(table.column("agent_name").to_pylist()) == {"critic"}


def test_without_agent_spans_the_service_name_is_the_agent(tmp_path):
    rows = []
    for rid, svc, r in (("a1", "planner", 1.0), ("a2", "planner", 0.0), ("b1", "coder", 1.0), ("b2", "coder", 0.0)):
        rows += [call(rid, 0, 10, agent=None, service_name=svc, task=svc),
                 reward(rid, 20, r, task=svc), runner(rid, 25, task=svc)]
    write(tmp_path, rows)
    table, metrics = build(tmp_path, agent_match="^coder$")
    got = rows_by_id(table)
    assert {r["rollout_id"] for r in got.values()} == {"b1", "b2"}
    assert {r["agent_name"] for r in got.values()} == {"coder"}
    assert metrics["transitions/dropped_rollouts/agent_mismatch"] == 2


def test_a_call_with_no_agent_anywhere_is_matched_as_the_empty_name(tmp_path):
    rows = []
    for rid, r in (("r1", 1.0), ("r2", 0.0)):
        rows += [call(rid, 0, 10, agent=None, service_name=None), reward(rid, 20, r), runner(rid, 25)]
    write(tmp_path, rows)
    table, _ = build(tmp_path)
    assert table.num_rows == 2 and table.column("agent_name").to_pylist() == [None, None]
    table, metrics = build(tmp_path, agent_match="solver")
    assert table.num_rows == 0 and metrics["transitions/dropped_rollouts/agent_mismatch"] == 2


def _supervisor_rollout(rid, value):
    """The spans traceloop's LangChain instrumentation (0.62.4) records for langgraph-supervisor's
    README quickstart when the supervisor hands off to ``math_expert`` (seen in a real run): each
    agent's ``invoke_agent NAME`` span is a sibling of its graph's node spans, and the calls sit
    under node ("task") spans, the outermost named after the agent, all under the parent graph's
    ``LangGraph.workflow`` agent span."""
    trace = f"{abs(hash(rid)) % 16**32:032x}"
    tl = lambda kind, name: dict(attributes=[("traceloop.span.kind", json.dumps(kind)),   # noqa: E731
                                             ("traceloop.entity.name", json.dumps(name))])
    rows = [span(rid, f"create_agent {n}", 0, 1, trace=f"{abs(hash(rid + n)) % 16**32:032x}",
                 operation_name="create_agent", agent_name=n) for n in ("math_expert", "supervisor")]
    graph = span(rid, "LangGraph.workflow", 2, 90, trace=trace, operation_name="invoke_agent", agent_name="LangGraph",
                 **tl("workflow", "LangGraph"))
    rows.append(graph)

    def agent_run(name, start, inner_node):
        node = span(rid, f"execute_task {name}", start, start + 30, trace=trace, parent_span_id=graph["span_id"],
                    **tl("task", name))
        invoked = span(rid, f"invoke_agent {name}", start + 1, start + 2, trace=trace, parent_span_id=node["span_id"],
                       operation_name="invoke_agent", agent_name=name)
        inner = span(rid, f"execute_task {name}", start + 2, start + 29, trace=trace, parent_span_id=node["span_id"],
                     **tl("task", name))
        step = span(rid, f"execute_task {inner_node}", start + 3, start + 28, trace=trace,
                    parent_span_id=inner["span_id"], **tl("task", inner_node))
        seq = span(rid, "execute_task RunnableSequence", start + 4, start + 27, trace=trace,
                   parent_span_id=step["span_id"], **tl("task", "RunnableSequence"))
        return [node, invoked, inner, step, seq,
                call(rid, start + 5, start + 26, agent=None, trace=trace, parent_span_id=seq["span_id"])]

    rows += agent_run("supervisor", 3, "agent") + agent_run("math_expert", 40, "agent")
    # a node named like no agent ("agent", "call_model") names none: the call above is the supervisor's
    return rows + [reward(rid, 95, value, trace=trace), runner(rid, 96, trace=trace)]


def test_a_langgraph_node_named_after_an_agent_runs_that_agent(tmp_path):
    write(tmp_path, _supervisor_rollout("r1", 1.0) + _supervisor_rollout("r2", 0.0))
    table, metrics = build(tmp_path)
    assert sorted(table.column("agent_name").to_pylist()) == ["math_expert", "math_expert", "supervisor", "supervisor"]
    table, metrics = build(tmp_path, agent_match="^supervisor$")
    assert table.column("agent_name").to_pylist() == ["supervisor", "supervisor"]
    assert metrics["transitions/dropped_calls/agent_mismatch"] == 2
