"""The layering of docs/architecture.md, pinned: which part may import which, what the agent side
imports, and what importing the collector loads.

Every ``import`` in a part's source counts, at module level or inside a function: a lazy import is
still a dependency. The CLI package (``lightspan/``) composes the processes and may import anything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("store", "collector", "tracing", "rollout", "lightningrl", "trainer", "dashboards")
COMMON = {"lightspan.config", "lightspan.progress", "lightspan.http"}   # shared by every server-side part

# part -> the lightspan modules it may import (a name covers its submodules); its own part always
ALLOWED = {
    "tracing": set(),
    "store": {"lightspan.config"},     # export's config; layout and policy stay standard library (below)
    "collector": {"lightspan.store", "lightspan.tracing.semconv", *COMMON},
    # the gateway captures with the instrumentor's own pure captures and message conversions
    "rollout": {"lightspan.store", "lightspan.tracing.semconv", "lightspan.tracing.capture",
                "lightspan.tracing.capture_responses", "lightspan.tracing.capture_anthropic",
                "lightspan.tracing.anthropic_convert", "lightspan.tracing.messages", "lightspan.tracing.urls",
                "lightspan.tracing.sse",
                "lightspan.tracing.spool",   # the runner reads back the spool the agent writes: one format
                *COMMON},
    "lightningrl": {"lightspan.store", "lightspan.tracing.semconv", *COMMON},
    "trainer": {"lightspan.store", "lightspan.tracing.semconv", *COMMON},
    "dashboards": {"lightspan.store", "lightspan.collector", "lightspan.lightningrl", "lightspan.trainer",
                   "lightspan.tracing.semconv", *COMMON},
}
# third-party packages a part may import (the standard library always)
THIRD_PARTY = {
    "tracing": {"opentelemetry", "wrapt", "orjson", "openai", "anthropic", "httpx", "httpx2"},
    "store": {"duckdb", "pyarrow", "fsspec"},   # fsspec: DuckDB reads s3:// by name through it (store/objects.py)
}
HEAVY = ("torch", "transformers", "trl", "duckdb", "grpc", "pyarrow", "accelerate", "peft")


def imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in ``path``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from lightspan.tracing import semconv` imports lightspan.tracing.semconv (and runs the
            # package's __init__, which the part rules cover by prefix)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def covered(name: str, allowed: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def part_files(part: str) -> list[Path]:
    files = sorted((ROOT / part).rglob("*.py"))
    assert files, f"{part}/ has no Python files"
    return files


@pytest.mark.parametrize("part", PARTS)
def test_a_part_imports_only_the_parts_below_it(part):
    own = f"lightspan.{part}"
    wrong = []
    for path in part_files(part):
        for name in imports(path):
            if not name.startswith("lightspan."):
                continue
            if not (covered(name, {own}) or covered(name, ALLOWED[part])):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("part", sorted(THIRD_PARTY))
def test_the_agent_side_and_the_store_import_only_their_libraries(part):
    wrong = []
    for path in part_files(part):
        for name in imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ("lightspan", "__future__") or top in THIRD_PARTY[part]:
                continue
            wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


def _loaded_after(statement: str, blocked: tuple[str, ...] = ()) -> set[str]:
    """The top-level modules loaded in a fresh interpreter by ``statement``; ``blocked`` ones fail
    to import there, as if they were not installed."""
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
sys.meta_path.insert(0, Block())
{statement}
print("\\n".join(sorted(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    return set(out.stdout.split())


def test_importing_the_collector_loads_no_rl_ui_or_torch():
    loaded = _loaded_after("import lightspan.collector.server, lightspan.collector.httpd")
    assert not {m for m in loaded if m.split(".")[0] == "torch"}
    assert not {m for m in loaded if m.startswith(("lightspan.lightningrl", "lightspan.dashboards",
                                                     "lightspan.trainer"))}


def test_the_agent_side_runs_without_the_heavy_stack():
    """The instrumentor, rollout() / emit_reward(), `lightspan rollout` and `lightspan jobs` work with
    torch, TRL, transformers, DuckDB, pyarrow and grpc missing, as in an agent's light install."""
    statement = """
import io, contextlib
import lightspan.tracing, lightspan.tracing.instrumentor, lightspan.rollout.runner, lightspan.rollout.k8s
from lightspan import cli, store
assert store.policy.served_version("/nonexistent") == 0
with contextlib.redirect_stdout(io.StringIO()):
    for job in ("rollout", "jobs"):
        try:
            cli.main([job, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, exc.code
"""
    loaded = _loaded_after(statement, blocked=HEAVY)
    assert not {m.split(".")[0] for m in loaded} & set(HEAVY)


def test_the_distribution_installs_the_agent_side_and_the_stack_as_one_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements):
        return {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].split("~")[0].strip().lower()
                for r in requirements}

    base = names(project["dependencies"])
    heavy = {"torch", "trl", "transformers", "duckdb", "grpcio", "pyarrow", "accelerate", "peft"}
    assert not base & heavy, f"the agent side would install {sorted(base & heavy)}"
    assert heavy <= names(project["optional-dependencies"]["full"])
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '".[full,' in setup, "scripts/setup.sh installs the whole stack"
