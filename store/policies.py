"""The policies one trace stream trains: which agents each owns, and what it sets for itself.

A workflow of several agents (a writer and a checker, a planner and its tools) can train one
policy per role. Each policy owns some agents, has its own LoRA adapter over the one shared base
model, its own optimizer state, checkpoints, policy version and staleness bound, and is served by
the same vLLM under its own model name — its ``name``, the model name its agents call. They are
listed once, as the ``[[policies]]`` tables of a TOML file::

    [[policies]]
    name = "writer"              # vLLM serves its adapter under this name; its agents call it
    agents = ["sql_writer"]      # attributed agent names it owns (lightningrl/selection.py)
    lora_r = 16

    [[policies]]
    name = "checker"
    agent_match = "checker$"     # or a Python regex searched in the attributed agent name
    credit = "discounted"

Every part that needs them reads that file, given as ``--policies FILE`` (or ``LIGHTSPAN_POLICIES``):
the transition builder (which policy owns each call, the credit of each), the trainer (an adapter,
an optimizer and a checkpoint lineage per policy) and ``lightspan vllm`` (how many adapters to
serve). What each policy serves now is policy.json (:mod:`lightspan.store.policy`).

The fields besides ``name``, ``agents`` and ``agent_match`` override that component's own setting
for the policy (unset: the component's value); the component validates them when it starts, and a
bad value is a ``ConfigError`` naming ``policies.<name>.<field>``. Checked here, at load: unknown
fields, names (unique, usable as a model name, not ``<name>-v<N>``, which weight sync uses for a
version), a policy that owns nothing, an agent named by two policies or named by one and matched by
another's regex. Two regexes that both match an agent are found when that agent is seen
(:func:`owner`). Standard library only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from lightspan.core.config import ConfigError, from_table, option

SECTION = "policies"
POLICIES_ENV = "LIGHTSPAN_POLICIES"
"""The policies file every job reads when its ``policies`` field is not given."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_VERSIONED = re.compile(r".*-v\d+")

TRAINER_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "learning_rate",
                  "weight_decay", "max_staleness", "batch_size", "min_transitions", "seed")
"""Per-policy overrides of ``[trainer]`` fields."""
TRANSITIONS_FIELDS = ("credit", "gamma", "advantage")
"""Per-policy overrides of ``[transitions]`` fields."""


@dataclass(frozen=True)
class PolicyConfig:
    """One ``[[policies]]`` table."""

    name: str = option("", "The policy's name: the model name vLLM serves its adapter under and its agents "
                       "call; also its checkpoint directory and its key in policy.json.")
    agents: tuple[str, ...] = option((), "Agent names it owns, exactly as the transition builder attributes "
                                     "calls (gen_ai.agent.name, an invoke_agent span, else service.name).")
    agent_match: str = option("", "A Python regex searched in each call's agent name: the agents it owns "
                              "besides those in agents.")
    # [trainer] overrides
    lora_r: int | None = option(None, "LoRA rank of its adapter (> 0).")
    lora_alpha: float | None = option(None, "LoRA alpha of its adapter.")
    lora_dropout: float | None = option(None, "LoRA dropout of its adapter.")
    lora_target_modules: str | None = option(None, "Modules its adapter targets (comma-separated).")
    learning_rate: float | None = option(None, "Its AdamW learning rate.")
    weight_decay: float | None = option(None, "Its AdamW weight decay.")
    max_staleness: int | None = option(None, "Its staleness bound, in its own versions.")
    batch_size: int | None = option(None, "Its transitions per optimizer step.")
    min_transitions: int | None = option(None, "Its minimum of new trainable transitions for a step.")
    seed: int | None = option(None, "Seed of its adapter's initialisation.")
    # [transitions] overrides
    credit: str | None = option(None, "Its credit assignment policy (identical, discounted).")
    gamma: float | None = option(None, "Its discount for credit 'discounted'.")
    advantage: str | None = option(None, "Its group advantage estimator (grpo, dr_grpo, rloo).")

    def owns(self, agent: str) -> bool:
        """Whether calls attributed to ``agent`` are this policy's."""
        return agent in self.agents or bool(self.agent_match and re.search(self.agent_match, agent))

    def overrides(self, fields: tuple[str, ...]) -> dict:
        """The fields among ``fields`` this policy sets."""
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


def path(value: str = "") -> str:
    """The policies file: ``value``, else ``$LIGHTSPAN_POLICIES``, else '' (no policies)."""
    return value or os.environ.get(POLICIES_ENV, "")


def load(file: str | os.PathLike) -> tuple[PolicyConfig, ...]:
    """The ``[[policies]]`` of TOML ``file``, validated (module docstring); ConfigError otherwise."""
    file = Path(file)
    try:
        with file.open("rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(SECTION, "file", f"cannot read {file} ({exc.strerror or exc})",
                          "pass an existing TOML file with [[policies]] tables") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(SECTION, "file", f"{file} is not TOML ({exc})", "fix the file's syntax") from None
    tables = doc.get(SECTION)
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(SECTION, "file", f"{file} has no [[policies]] tables",
                          "add one [[policies]] table per policy, each with a name and the agents it owns")
    return validate([_entry(table, i, file) for i, table in enumerate(tables)])


def _entry(table: dict, index: int, file: Path) -> PolicyConfig:
    label = str(table.get("name") or f"[{index}]")
    if isinstance(table.get("agents"), str):       # agents = "a" instead of ["a"]: one name
        table = {**table, "agents": [table["agents"]]}
    return from_table(PolicyConfig, section=f"{SECTION}.{label}", table=table, where=str(file))


def validate(policies: list[PolicyConfig]) -> tuple[PolicyConfig, ...]:
    """``policies``, checked as the module docstring says; ConfigError names the field and the fix."""
    seen: dict[str, PolicyConfig] = {}
    for p in policies:
        def bad(name: str, problem: str, fix: str):
            raise ConfigError(SECTION, f"{p.name or '?'}.{name}", problem, fix)

        if not _NAME.fullmatch(p.name):
            bad("name", f"{p.name!r} is not a model name (letters, digits, '.', '_', '-'; at most 64)",
                "give each policy a name such as name = \"writer\"")
        if _VERSIONED.fullmatch(p.name):
            bad("name", f"{p.name!r} ends like a versioned name (<name>-v<N>), which weight sync loads each "
                "version under", "pick a name that does not end in -v<digits>")
        if p.name in seen:
            bad("name", "two policies have this name", "give every policy its own name")
        try:
            re.compile(p.agent_match)
        except re.error as exc:
            bad("agent_match", f"{p.agent_match!r} is not a valid regex ({exc})", "give a Python regular expression")
        if not p.agents and not p.agent_match:
            bad("agents", "the policy owns no agent", "list its agents (agents = [\"name\"]) or give agent_match")
        for agent in p.agents:
            if not agent:
                bad("agents", "holds an empty name", "list the agent names it owns")
            other = next((q for q in seen.values() if q.owns(agent)), None)
            if other is not None:
                bad("agents", f"agent {agent!r} is owned by policy {other.name!r} too",
                    "give each agent to one policy (agents and agent_match must not overlap)")
        for q in seen.values():
            taken = next((a for a in q.agents if p.owns(a)), None)
            if taken is not None:
                bad("agent_match", f"{p.agent_match!r} matches agent {taken!r}, which policy {q.name!r} owns",
                    "make agent_match exclude the other policies' agents")
        seen[p.name] = p
    return tuple(policies)


def owner(policies: tuple[PolicyConfig, ...], agent: str) -> PolicyConfig | None:
    """The policy that owns ``agent``, or None; ConfigError when two do (two agent_match patterns)."""
    found = [p for p in policies if p.owns(agent)]
    if len(found) > 1:
        raise ConfigError(SECTION, f"{found[1].name}.agent_match",
                          f"agent {agent!r} is owned by policies {found[0].name!r} and {found[1].name!r}",
                          "make the agent_match patterns disjoint, or list the agent in one policy's agents")
    return found[0] if found else None


def override(config, policy: PolicyConfig, fields: tuple[str, ...], **more):
    """``config`` (a component's frozen config) with ``policy``'s settings among ``fields`` (and the
    fields ``more`` sets), validated by the component's own checks; a bad value is reported as
    ``policies.<name>.<field>``."""
    try:
        return dataclasses.replace(config, **more, **policy.overrides(fields))
    except ConfigError as exc:
        name = exc.field.split(".", 1)[1]
        problem, _, fix = str(exc).split(": ", 1)[1].partition("; fix: ")
        where = name if name in fields else f"(the {exc.field.split('.', 1)[0]} setting {name})"
        raise ConfigError(SECTION, f"{policy.name}.{where}", problem, fix) from None
