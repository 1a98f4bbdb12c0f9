"""An agent that exits 75 (sysexits' EX_TEMPFAIL: a service it needs is down) is an infrastructure
failure: outcome infra, retried, recorded as infra; any other non-zero exit stays the agent's failure."""

from __future__ import annotations

import json
import sys

from lightspan.rollout import outcomes, runner


def test_exit_status_75_is_infrastructure_and_others_are_the_agents():
    assert outcomes.INFRA_EXIT_CODE == 75
    assert [outcomes.exit_outcome(c) for c in (0, 1, 2, 75, 76, -9, -15)] == \
        ["ok", "failed", "failed", "infra", "failed", "infra", "infra"]


def test_a_process_that_exits_75_is_an_infra_outcome(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "t1"}) + "\n")
    cfg = runner.RolloutConfig(tasks=str(path), data_dir=str(tmp_path))
    code = "import os, sys; print('retriever down', file=sys.stderr); sys.exit(os.EX_TEMPFAIL)"
    o = runner.run_one(cfg, [sys.executable, "-c", code], {"id": "t1"}, 0, None, tmp_path)
    assert (o.outcome, o.exit_code, o.end) == ("infra", 75, ("exit", None))
