"""Selection and drop accounting: time and model-version windows, truncated and duplicate calls,
re-sent and late spans (lightningrl/selection.py, lightningrl/config.py)."""

import pytest

from lightspan.core.config import ConfigError, resolve
from lightspan.lightningrl import builder
from lightspan.lightningrl.config import TransitionsConfig, parse_time
from tests.lightningrl.helpers import NOW, T0, build, call, episode, reward, runner, write


def dropped(m, kind="rollouts"):
    return {k.rsplit("/", 1)[1]: v for k, v in m.items() if f"dropped_{kind}/" in k and v}


# --- config -----------------------------------------------------------------------------------

def test_times_parse_as_iso_or_unix_nanoseconds():
    assert parse_time("") is None
    assert parse_time("1800000000000000000") == 1_800_000_000 * 10**9
    assert parse_time("2027-01-15T08:00:00Z") == parse_time("2027-01-15T09:00:00+01:00") \
        == parse_time("2027-01-15T08:00:00") == T0              # no zone: UTC
    assert parse_time("2027-01-15T08:00:00.000001Z") == parse_time("2027-01-15T08:00:00Z") + 1000


@pytest.mark.parametrize("field, value", [
    ("since", "yesterday"), ("until", "2027-13-01"), ("output", "per_token"),
    ("min_model_version", 1.5), ("watermark_lag_s", -1.0),
])
def test_config_rejects_bad_selection_values(field, value):
    with pytest.raises(ConfigError) as err:
        TransitionsConfig(**{field: value})
    assert err.value.field == f"transitions.{field}" and "fix:" in str(err.value)


def test_config_rejects_empty_windows():
    with pytest.raises(ConfigError, match="transitions.until"):
        TransitionsConfig(since="2027-01-02T00:00:00Z", until="2027-01-01T00:00:00Z")
    with pytest.raises(ConfigError, match="transitions.max_model_version"):
        TransitionsConfig(min_model_version=5, max_model_version=4)


def test_new_options_come_from_the_command_line_and_environment():
    cfg = resolve(TransitionsConfig, section="transitions",
                  environ={"LIGHTSPAN_TRANSITIONS_DROP_TRUNCATED": "true"},
                  cli={"output": "per_rollout", "min_model_version": "3", "since": "2027-01-15T00:00:00Z",
                       "incremental": "false"})
    assert (cfg.output, cfg.min_model_version, cfg.max_model_version, cfg.drop_truncated, cfg.incremental) == \
        ("per_rollout", 3, None, True, False)
    assert cfg.since_unix_nano == parse_time("2027-01-15T00:00:00Z") and cfg.until_unix_nano is None


# --- windows ----------------------------------------------------------------------------------

def test_time_window_on_rollout_start(tmp_path):
    sec = 10**9
    rows = []
    for i, rid in enumerate(("early", "a", "b", "late")):      # rollouts start at T0 + 0, 100, 200, 300 s
        rows += [r | {"start_time_unix_nano": r["start_time_unix_nano"] + 100 * i * sec,
                      "end_time_unix_nano": r["end_time_unix_nano"] + 100 * i * sec}
                 for r in episode(rid, float(i % 2))]
    write(tmp_path, rows)
    since, until = str(T0 + 100 * sec), str(T0 + 300 * sec)    # [since, until): a and b
    table, m = build(tmp_path, since=since, until=until)
    assert set(table.column("rollout_id").to_pylist()) == {"a", "b"}
    assert dropped(m) == {"time_window": 2}
    iso, _ = build(tmp_path, since="2027-01-15T08:01:40Z")      # T0 + 100 s, as ISO 8601
    assert parse_time("2027-01-15T08:01:40Z") == T0 + 100 * sec
    assert set(iso.column("rollout_id").to_pylist()) == {"a", "b", "late"}


def test_model_version_window(tmp_path):
    rows = episode("v2", 1.0, version=2) + episode("v3", 0.0, version=3) + episode("v4", 1.0, version=4)
    rows += [call("mixed", 0, 10, version=3), call("mixed", 20, 30, version=5), reward("mixed", 40, 0.0),
             runner("mixed", 45)]
    rows += [call("unknown", 0, 10, version=None), reward("unknown", 20, 0.5), runner("unknown", 25)]
    write(tmp_path, rows)
    table, m = build(tmp_path, min_model_version=3, max_model_version=4)
    assert set(table.column("rollout_id").to_pylist()) == {"v3", "v4"}
    assert dropped(m) == {"model_version": 3}          # v2, mixed (a call at 5), unknown (no version)
    everything, m = build(tmp_path)
    assert set(everything.column("rollout_id").to_pylist()) == {"v2", "v3", "v4", "mixed", "unknown"}


def test_only_the_configured_split_is_built_and_the_rest_counted(tmp_path):
    write(tmp_path, episode("a", 1.0) + episode("b", 0.0) + episode("v", 1.0, split="val"))
    _, m = build(tmp_path)
    assert dropped(m) == {"split": 1} and m["transitions/rollouts"] == 2


# --- truncated calls --------------------------------------------------------------------------

def test_truncated_calls_are_counted_and_optionally_dropped(tmp_path):
    rows = [call("a", 0, 10, finish="length"), call("a", 20, 30, finish="stop"), reward("a", 40, 1.0),
            runner("a", 45)]
    rows += [call("b", 0, 10, finish="length"), reward("b", 20, 0.0), runner("b", 25)]
    rows += episode("c", 0.5, finish="stop") + episode("d", 0.0)
    write(tmp_path, rows)
    kept, m = build(tmp_path)
    assert kept.num_rows == 5 and m["transitions/truncated_calls"] == 2 and not dropped(m, "calls")
    table, m = build(tmp_path, drop_truncated=True)
    assert {(r["rollout_id"], r["call_index"]) for r in table.to_pylist()} == {("a", 0), ("c", 0), ("d", 0)}
    assert dropped(m) == {"truncated": 1}                     # b: its only call ran out of tokens
    assert dropped(m, "calls") == {"truncated": 1}            # a's first call
    assert m["transitions/truncated_calls"] == 1              # among the emitted rollouts
    a = [r for r in table.to_pylist() if r["rollout_id"] == "a"]
    assert [(r["call_index"], r["num_calls"]) for r in a] == [(0, 1)]


# --- duplicates -------------------------------------------------------------------------------

def test_nested_llm_spans_of_two_instrumentations_collapse_into_one(tmp_path):
    # the outer span (OpenAI instrumentation, no token ids) wraps the inner one that has them
    outer = call("a", 0, 12, tokens=False, span_id="00000000000000aa")
    inner = call("a", 1, 11, parent_span_id="00000000000000aa", trace=outer["trace_id"])
    # the other way round: token ids on the outer span, an inner span without
    outer2 = call("a", 20, 32, span_id="00000000000000bb", trace=outer["trace_id"], completion=(6,))
    inner2 = call("a", 21, 31, tokens=False, parent_span_id="00000000000000bb", trace=outer["trace_id"])
    rows = [outer, inner, outer2, inner2, reward("a", 40, 1.0, trace=outer["trace_id"]),
            runner("a", 45, trace=outer["trace_id"])] + episode("b", 0.0)
    write(tmp_path, rows)
    table, m = build(tmp_path)
    a = sorted((r for r in table.to_pylist() if r["rollout_id"] == "a"), key=lambda r: r["call_index"])
    assert [(r["transition_id"].split("/")[1], r["num_calls"]) for r in a] == [
        (inner["span_id"], 2), ("00000000000000bb", 2)]
    assert dropped(m, "calls") == {"duplicate": 2}
    assert m["transitions/calls"] == 3


def test_spans_the_instrumentor_marked_duplicate_are_not_calls(tmp_path):
    marked = call("a", 0, 12, capture_status="duplicate", completion=(9,))     # not even the parent
    write(tmp_path, [marked, call("a", 1, 11)] + [reward("a", 20, 1.0), runner("a", 25)] + episode("b", 0.0))
    table, m = build(tmp_path)
    assert sorted(r["completion_token_ids"] for r in table.to_pylist() if r["rollout_id"] == "a") == [[4, 5]]
    assert dropped(m, "calls") == {"duplicate": 1}


def test_resent_spans_are_counted_once(tmp_path):
    rows = episode("a", 1.0, calls=2) + episode("b", 0.0)
    write(tmp_path, rows)
    write(tmp_path, rows[:3])                 # a retried export: the same spans again
    table, m = build(tmp_path)
    assert table.num_rows == 3 and m["transitions/duplicate_spans"] == 3
    assert m["transitions/spans_read"] == len(rows) + 3


def test_spans_arriving_after_a_build_are_ignored_and_counted(tmp_path):
    write(tmp_path, episode("a", 1.0) + episode("b", 0.0))
    cfg = TransitionsConfig(data_dir=str(tmp_path))
    assert builder.run(cfg, now_unix_nano=NOW)["transitions/rollouts"] == 2
    late = reward("a", 30, 5.0) | {"received_unix_nano": NOW + 10**9}   # a late reward, after the build
    write(tmp_path, [late])
    m = builder.run(cfg, now_unix_nano=NOW + 2 * 10**9)
    assert m["transitions/rollouts"] == 0 and dropped(m) == {"duplicate": 1}
    table, full = build(tmp_path)                              # a full read: b is just done, a is late
    assert table.num_rows == 0 and full["transitions/already_built"] == 2 and dropped(full) == {"duplicate": 1}
