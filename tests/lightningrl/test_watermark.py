"""Incremental builds: the watermark in data_dir/lightningrl/state.json (lightningrl/watermark.py)."""

import json

from lightspan import store
from lightspan.lightningrl import builder, watermark
from lightspan.lightningrl.config import TransitionsConfig
from tests.lightningrl.helpers import NOW, call, episode, reward, write

SEC = 10**9


def run(d, now=NOW, **cfg):
    return builder.run(TransitionsConfig(data_dir=str(d), **cfg), now_unix_nano=now)


def transition_ids(d):
    con = store.connect(d)
    try:
        return [r[0] for r in con.execute("SELECT transition_id FROM transitions").fetchall()]
    finally:
        con.close()


def test_a_second_build_over_a_large_unchanged_store_reads_no_old_rollout(tmp_path):
    rollouts = 3000
    for part in range(3):                      # 3 files of 1000 rollouts, 2 calls each: 12000 spans
        write(tmp_path, [row for i in range(part * 1000, (part + 1) * 1000)
                         for row in episode(f"r{i:05d}", float(i % 2), task=f"t{i // 4}", calls=2)])
    first = run(tmp_path)
    assert first["transitions/rollouts"] == rollouts and first["transitions/calls"] == 2 * rollouts
    assert first["transitions/spans_read"] == 4 * rollouts and first["transitions/token_files_read"] == 3

    second = run(tmp_path, now=NOW + 60 * SEC)
    assert second["transitions/spans_read"] == 0 and second["transitions/token_files_read"] == 0
    assert second["transitions/rollouts"] == 0 and second["transitions/already_built"] == 0

    fresh = episode("new-a", 1.0, task="fresh") + episode("new-b", 0.0, task="fresh")
    write(tmp_path, [r | {"received_unix_nano": NOW + 100 * SEC} for r in fresh])
    third = run(tmp_path, now=NOW + 120 * SEC)
    assert third["transitions/spans_read"] == 6 and third["transitions/token_files_read"] == 1
    assert third["transitions/rollouts"] == 2 and third["transitions/calls"] == 2
    ids = transition_ids(tmp_path)
    assert len(ids) == len(set(ids)) == 2 * rollouts + 2


def test_incomplete_and_small_group_rollouts_are_read_again_without_new_spans(tmp_path):
    rows = episode("a", 1.0) + episode("b", 0.0) + episode("c", 1.0, task="t2")
    rows += [call("d", 0, 10, task="t2"), reward("d", 20, 0.0, task="t2")]   # no runner end span yet
    for r in rows[-2:]:
        r["end_time_unix_nano"] = NOW - 5 * SEC        # ended 5 s before the build
    write(tmp_path, rows)
    first = run(tmp_path, grace_s=30.0)
    assert first["transitions/rollouts"] == 2
    assert first["transitions/dropped_rollouts/incomplete"] == 1        # d
    assert first["transitions/dropped_rollouts/small_group"] == 1       # c: its sibling is not done
    assert first["transitions/pending_rollouts"] == 2
    state = json.loads((tmp_path / "lightningrl" / "state.json").read_text())
    (entry,) = state["selections"].values()
    assert entry["pending"] == ["c", "d"] and entry["config"]["split"] == "train"

    second = run(tmp_path, now=NOW + 60 * SEC, grace_s=30.0)         # no new span; the grace is over
    assert second["transitions/rollouts"] == 2 and second["transitions/groups"] == 1
    assert second["transitions/spans_read"] == 5                      # c's 3 spans and d's 2, no others
    assert second["transitions/pending_rollouts"] == 0
    assert len(transition_ids(tmp_path)) == 4


def test_spans_received_within_the_lag_are_read_again_never_emitted_twice(tmp_path):
    write(tmp_path, episode("a", 1.0) + episode("b", 0.0))
    newest = max(r["received_unix_nano"] for r in episode("x", 0.0))
    first = run(tmp_path, now=newest + 10 * SEC, watermark_lag_s=300.0)
    assert first["transitions/rollouts"] == 2
    assert first["transitions/watermark_unix_nano"] < newest          # still within the lag
    second = run(tmp_path, now=newest + 20 * SEC, watermark_lag_s=300.0)
    assert second["transitions/spans_read"] == 6 and second["transitions/already_built"] == 2
    assert second["transitions/rollouts"] == 0 and second["transitions/dropped_rollouts/duplicate"] == 0
    third = run(tmp_path, now=newest + 400 * SEC, watermark_lag_s=300.0)
    assert third["transitions/watermark_unix_nano"] == newest
    assert run(tmp_path, now=newest + 500 * SEC, watermark_lag_s=300.0)["transitions/spans_read"] == 0
    assert len(transition_ids(tmp_path)) == 2


def test_another_selection_reads_every_span(tmp_path):
    write(tmp_path, episode("a", 1.0) + episode("b", 0.0) + episode("v", 1.0, split="val")
          + episode("w", 0.0, split="val"))
    train = run(tmp_path)
    assert train["transitions/rollouts"] == 2 and train["transitions/dropped_rollouts/split"] == 2
    assert run(tmp_path, now=NOW + 60 * SEC)["transitions/spans_read"] == 0
    val = run(tmp_path, now=NOW + 60 * SEC, split="val")            # dropped for good by 'train', wanted now
    assert val["transitions/rollouts"] == 2 and val["transitions/spans_read"] == 12
    assert run(tmp_path, now=NOW + 90 * SEC, split="val")["transitions/spans_read"] == 0
    assert run(tmp_path, now=NOW + 90 * SEC)["transitions/spans_read"] == 0   # train's state is kept too
    assert sorted(json.loads((tmp_path / "lightningrl" / "state.json").read_text())["selections"]) == sorted(
        watermark.selection(TransitionsConfig(split=s)) for s in ("train", "val"))


def test_a_damaged_state_or_incremental_off_reads_everything(tmp_path):
    write(tmp_path, episode("a", 1.0) + episode("b", 0.0))
    run(tmp_path)
    (tmp_path / "lightningrl" / "state.json").write_text("{not json")
    again = run(tmp_path, now=NOW + 60 * SEC)
    assert again["transitions/spans_read"] == 6 and again["transitions/rollouts"] == 0
    assert run(tmp_path, now=NOW + 90 * SEC)["transitions/spans_read"] == 0
    off = run(tmp_path, now=NOW + 90 * SEC, incremental=False)
    assert off["transitions/spans_read"] == 6 and off["transitions/already_built"] == 2
    assert len(transition_ids(tmp_path)) == 2


def test_selection_ignores_where_and_how_often():
    assert watermark.selection(TransitionsConfig(data_dir="/a", watermark_lag_s=1.0)) == \
        watermark.selection(TransitionsConfig(data_dir="/b", incremental=False))
    assert watermark.selection(TransitionsConfig()) != watermark.selection(TransitionsConfig(agent_match="x"))
