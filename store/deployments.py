"""Which policy versions serve, as canary decisions: the ``deployments`` table and its fold.

A new policy version reaches users as a canary (rollout/canary.py): the gateway gives it a share of
rollouts, compares its rewards with the serving version's and promotes or rolls it back; a person
may do either by hand (``lightspan deploy``). Each decision is one row of ``deployments/``
(:data:`~lightspan.store.schema.DEPLOYMENT_SCHEMA`, one Parquet file per decision, written
atomically before the decision takes effect), so ``lightspan sql "SELECT * FROM deployments"``
shows every decision with its evidence, and a gateway that restarts reads back exactly what it
had decided. What serves now is the fold of the rows in time order (:func:`fold`):

- ``serve``: the version that served when canaries were enabled (the first row of a policy);
- ``canary``: the version gets ``share`` of rollouts from then on (a newer canary replaces an
  undecided one: it supersedes it);
- ``promote``: the version serves everyone (automatic, or by hand: also a rolled-back version);
- ``rollback``: the version never serves again unless promoted by hand; rolling back the serving
  version restores the one promoted before it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from lightspan.store.files import write_table
from lightspan.store.location import Location
from lightspan.store.schema import DEPLOYMENT_SCHEMA

TABLE = "deployments"
SERVE, CANARY, PROMOTE, ROLLBACK = "serve", "canary", "promote", "rollback"
ACTIONS = (SERVE, CANARY, PROMOTE, ROLLBACK)
AUTO, MANUAL = "auto", "manual"


@dataclass(frozen=True)
class Deployment:
    """What serves one policy now (``policy``: its name, "" for the unnamed policy)."""

    policy: str
    serving: int | None = None               # the stable version: everyone but the canary's share
    serving_checkpoint: str = ""
    candidate: int | None = None             # the canary, undecided; None: no canary
    candidate_checkpoint: str = ""
    share: float = 0.0                       # the canary's share of rollouts
    since_unix_nano: int = 0                 # when the canary began (its evidence starts there)
    rolled_back: frozenset[int] = frozenset()
    history: tuple[tuple[int, str], ...] = field(default=(), repr=False)   # promoted (version, checkpoint), oldest first

    def decided(self, version: int) -> bool:
        """Whether ``version`` was served, promoted or rolled back already (never a canary again)."""
        return version in self.rolled_back or any(v == version for v, _ in self.history)


def row(policy: str, version: int, action: str, *, actor: str = AUTO, reason: str = "", **evidence) -> dict:
    """One decision as a row of the table (every column; the evidence columns given by name)."""
    if action not in ACTIONS:
        raise ValueError(f"unknown deployment action {action!r}; one of {', '.join(ACTIONS)}")
    unknown = set(evidence) - set(DEPLOYMENT_SCHEMA.names)
    if unknown:
        raise ValueError(f"not columns of {TABLE}: {', '.join(sorted(unknown))}")
    doc = dict.fromkeys(DEPLOYMENT_SCHEMA.names)
    doc.update(evidence, time_unix_nano=evidence.get("time_unix_nano") or time.time_ns(), policy=policy or None,
               version=int(version), action=action, actor=actor, reason=reason)
    return doc


def fold(rows) -> dict[str, Deployment]:
    """The deployment of each policy after ``rows`` (dicts of the table), applied in time order."""
    out: dict[str, Deployment] = {}
    for r in sorted(rows, key=lambda r: (r["time_unix_nano"], ACTIONS.index(r["action"]))):
        name, version, checkpoint = r["policy"] or "", int(r["version"]), r.get("checkpoint") or ""
        d = out.get(name) or Deployment(name)
        if r["action"] in (SERVE, PROMOTE):
            history = tuple(h for h in d.history if h[0] != version) + ((version, checkpoint or _path(d, version)),)
            d = Deployment(name, version, history[-1][1], None if d.candidate == version else d.candidate,
                           d.candidate_checkpoint, d.share, d.since_unix_nano, d.rolled_back - {version}, history)
            if d.candidate is None:
                d = _no_candidate(d)
        elif r["action"] == CANARY:
            if version in d.rolled_back or version == d.serving:
                continue                       # decided meanwhile (another gateway, a person)
            if d.candidate != version:         # the same canary written twice keeps its start
                d = Deployment(name, d.serving, d.serving_checkpoint, version, checkpoint, float(r["share"] or 0.0),
                               int(r["time_unix_nano"]), d.rolled_back, d.history)
        elif r["action"] == ROLLBACK:
            history = tuple(h for h in d.history if h[0] != version)
            serving, serving_checkpoint = (history[-1] if history else (None, "")) if d.serving == version \
                else (d.serving, d.serving_checkpoint)
            d = Deployment(name, serving, serving_checkpoint, d.candidate, d.candidate_checkpoint, d.share,
                           d.since_unix_nano, d.rolled_back | {version}, history)
            if d.candidate == version:
                d = _no_candidate(d)
        out[name] = d
    return out


def _no_candidate(d: Deployment) -> Deployment:
    return Deployment(d.policy, d.serving, d.serving_checkpoint, rolled_back=d.rolled_back, history=d.history)


def _path(d: Deployment, version: int) -> str:
    return d.candidate_checkpoint if d.candidate == version else ""


def record(data_dir, rows: list[dict]) -> None:
    """Write ``rows`` (:func:`row`) as one file of the table, atomically: all of them or none."""
    if rows:
        write_table(data_dir, TABLE, pa.Table.from_pylist(rows, schema=DEPLOYMENT_SCHEMA))


class Reader:
    """The table's rows, read incrementally: each file once (files are written once, never changed)."""

    def __init__(self, data_dir: str | os.PathLike | Location | None):
        self.where = Location.of(data_dir)
        self._rows: dict[str, list[dict]] = {}
        self._lock = threading.Lock()

    def rows(self) -> list[dict]:
        with self._lock:
            keys = [e.key for e in self.where.list(TABLE, stat=False) if e.key.endswith(".parquet")
                    and e.key.rsplit("/", 1)[-1].startswith("part-")]
            for key in keys:
                if key not in self._rows:
                    try:
                        data = self.where.read_bytes(key)
                    except FileNotFoundError:
                        continue
                    # no Arrow thread (a few rows): its pools' threads, left running, can abort the
                    # interpreter at exit (apache/arrow#34314; `lightspan deploy list` 5 of 40 runs)
                    table = pq.read_table(pa.BufferReader(data), use_threads=False, pre_buffer=False)
                    self._rows[key] = table.to_pylist()
            return [r for key in keys for r in self._rows.get(key, ())]

    def state(self) -> dict[str, Deployment]:
        return fold(self.rows())


def state(data_dir) -> dict[str, Deployment]:
    """The deployment of each policy with a decision (``""``: the unnamed policy); {} before any."""
    return Reader(data_dir).state()


def arm_rewards(con, policy: str, versions: tuple[int, ...], since_unix_nano: int, window: int) -> dict[int, list[float]]:
    """The final rewards of the latest ``window`` rewarded rollouts of each of ``versions`` of
    ``policy`` ("" the unnamed one) started since ``since_unix_nano``, oldest first, over the views
    of DuckDB connection ``con`` (:func:`lightspan.store.views.connect`). A rollout counts for the
    version that served all its calls (named policies) or its latest call (the unnamed policy)."""
    if policy:
        source = ("SELECT model_version, final_reward, start_time_unix_nano FROM policy_rollouts "
                  "WHERE policy = $policy AND min_model_version = model_version")
    else:
        source = ("SELECT model_version, final_reward, start_time_unix_nano FROM rollouts "
                  "WHERE len(policies) = 0 AND $policy = ''")
    rows = con.execute(f"""
        SELECT model_version, final_reward FROM ({source}) r
        WHERE final_reward IS NOT NULL AND list_contains($versions, model_version)
          AND start_time_unix_nano >= $since
        QUALIFY row_number() OVER (PARTITION BY model_version ORDER BY start_time_unix_nano DESC) <= $window
        ORDER BY start_time_unix_nano""",
        {"policy": policy, "versions": list(versions), "since": since_unix_nano, "window": window}).fetchall()
    out: dict[int, list[float]] = {v: [] for v in versions}
    for version, reward in rows:
        out[int(version)].append(float(reward))
    return out


def summary(con, decisions: int = 5) -> dict:
    """For ``lightspan status`` and the web UI, from the views of DuckDB connection ``con``: per
    policy the serving version, the candidate with its share and each arm's rewarded rollouts and
    mean reward since the canary began, the rolled-back versions; the latest ``decisions`` rows."""
    cursor = con.execute(f"SELECT * FROM {TABLE}")
    names = [c[0] for c in cursor.description]
    rows = [dict(zip(names, r)) for r in cursor.fetchall()]
    policies = []
    for name, d in sorted(fold(rows).items()):
        doc = {"policy": name, "serving": d.serving, "candidate": d.candidate, "share": d.share if d.candidate else 0.0,
               "since_unix_nano": d.since_unix_nano or None, "rolled_back": sorted(d.rolled_back), "arms": None}
        if d.candidate is not None and d.serving is not None:
            rewards = arm_rewards(con, name, (d.candidate, d.serving), d.since_unix_nano, 1 << 31)
            doc["arms"] = {str(v): {"rollouts": len(r), "reward_mean": sum(r) / len(r) if r else None}
                           for v, r in rewards.items()}
        policies.append(doc)
    keep = ("time_unix_nano", "policy", "version", "action", "actor", "share", "serving_version", "candidate_rollouts",
            "serving_rollouts", "candidate_reward_mean", "serving_reward_mean", "p_value", "reason")
    latest = sorted(rows, key=lambda r: r["time_unix_nano"], reverse=True)[:decisions]
    return {"policies": policies, "decisions": [{k: r[k] for k in keep} for r in latest]}
