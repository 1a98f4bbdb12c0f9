"""The layering of docs/architecture.md, pinned: which part may import which, what the agent side
imports, and what importing the collector loads.

Every import in a part's source counts: at module level or inside a function (a lazy import is
still a dependency), relative (``from .credit import x`` is ``lightspan.lightningrl.credit``) or
dynamic (``importlib.import_module`` / ``__import__`` of a string the module names). ``core`` is the
ground and imports no part; ``lightspan/`` is the face (the CLI, experiment, demo, model
preparation, the vLLM launcher), which composes the processes: it may import anything and no part
imports it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("core", "store", "collector", "tracing", "rollout", "lightningrl", "trainer", "dashboards")
CORE = {"lightspan.core"}   # the ground every server-side part stands on

# part -> the lightspan modules it may import (a name covers its submodules); its own part always
ALLOWED = {
    "core": set(),
    "tracing": set(),
    "store": {*CORE},
    "collector": {"lightspan.store", "lightspan.tracing.semconv", *CORE},
    # the gateway is a transport over the instrumentor's own protocol table (pure: captures, request
    # rewrites, conversions, message shapes, stream relays, error shapes)
    "rollout": {"lightspan.store", "lightspan.tracing.semconv", "lightspan.tracing.protocols",
                "lightspan.tracing.messages",
                "lightspan.tracing.spool",   # the runner reads back the spool the agent writes: one format
                *CORE},
    "lightningrl": {"lightspan.store", "lightspan.tracing.semconv", *CORE},
    "trainer": {"lightspan.store", "lightspan.tracing.semconv", *CORE},
    "dashboards": {"lightspan.store", "lightspan.tracing.semconv", *CORE},
}
# third-party packages a part may import (the standard library always)
THIRD_PARTY = {
    "core": {"orjson", "rich"},
    "tracing": {"opentelemetry", "wrapt", "orjson", "openai", "anthropic", "httpx", "httpx2"},
    "store": {"duckdb", "pyarrow", "fsspec", "numpy"},   # fsspec: DuckDB reads s3:// by name through it (store/objects.py)
}
HEAVY = ("torch", "transformers", "trl", "duckdb", "grpc", "pyarrow", "accelerate", "peft")
# dynamic imports whose module is computed, not named: what each one loads, and why it is allowed
COMPUTED = {
    "store/__init__.py": "the store's own modules, loaded lazily by attribute (_LAZY)",
    "tracing/hooks.py": "the client library a hook patches (openai, anthropic), once it is imported",
    "rollout/agent_class.py": "the agent's own module, named on the command line",
    "rollout/zygote.py": "the agent's imports, read from its script, preloaded before forking",
}


def _package(path: Path) -> str:
    """The installed package of a file: ``lightningrl/credit.py`` is in ``lightspan.lightningrl``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    folders = parts if path.name == "__init__.py" else parts[:-1]
    folders = folders[:-1] if path.name == "__init__.py" else folders
    if folders and folders[0] == "lightspan":
        folders = folders[1:]
    return ".".join(("lightspan", *folders))


def _strings(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level names bound to a string or a tuple/list of strings (what a dynamic import may name)."""
    named = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            items = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value]
            if items and all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
                named[node.targets[0].id] = [i.value for i in items]
    return named


def _dynamic(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module"
            and isinstance(f.value, ast.Name) and f.value.id == "importlib") or (
        isinstance(f, ast.Name) and f.id in ("__import__", "import_module"))


def imports(path: Path) -> tuple[set[str], list[int]]:
    """Absolute module names imported anywhere in ``path`` (relative and named dynamic imports
    resolved), and the lines of dynamic imports whose module is computed."""
    tree = ast.parse(path.read_text(), str(path))
    package, named, names, computed = _package(path), _strings(tree), set(), []
    for node in ast.walk(tree):       # `for m in MODULES: importlib.import_module(m)` names MODULES
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Name):
            named.setdefault(node.target.id, named.get(node.iter.id, []))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            # `from lightspan.tracing import semconv` imports lightspan.tracing.semconv (and runs the
            # package's __init__, which the part rules cover by prefix)
            names.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and _dynamic(node) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
            elif isinstance(arg, ast.Name) and named.get(arg.id):
                names.update(named[arg.id])
            else:
                computed.append(node.lineno)
    return names, computed


def covered(name: str, allowed: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def part_files(part: str) -> list[Path]:
    files = sorted((ROOT / part).rglob("*.py"))
    assert files, f"{part}/ has no Python files"
    return files


def test_imports_are_resolved_relative_and_dynamic(tmp_path, monkeypatch):
    """The resolver: a relative import names its package's module, a dynamic import of a named string counts."""
    (tmp_path / "lightningrl").mkdir()
    probe = tmp_path / "lightningrl" / "probe.py"
    probe.write_text("import importlib\nfrom .credit import x\nfrom .. import dashboards\n"
                     "MODULES = ('lightspan.cli',)\n"
                     "def f(name):\n    for m in MODULES:\n        importlib.import_module(m)\n"
                     "    importlib.import_module('lightspan.experiment')\n    __import__(name)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    names, computed = imports(probe)
    assert {"lightspan.lightningrl.credit.x", "lightspan.dashboards", "lightspan.cli", "lightspan.experiment"} <= names
    assert computed == [9]


def test_relative_imports_are_counted():
    """lightningrl/ imports its own modules relatively: each is seen, under its absolute name."""
    relative = [(p, m) for p in part_files("lightningrl") for m in re.findall(r"^\s*from \.(\w*) import", p.read_text(), re.M)]
    assert relative
    for path, module in relative:
        names = imports(path)[0]
        want = f"lightspan.lightningrl.{module}" if module else "lightspan.lightningrl"
        assert any(n.startswith(want + ".") for n in names), f"{path.name}: from .{module} not resolved"


def test_dynamic_imports_of_computed_modules_are_the_listed_ones():
    found = {str(path.relative_to(ROOT)) for part in PARTS for path in part_files(part) if imports(path)[1]}
    assert found == set(COMPUTED), f"computed imports in {sorted(found)}; listed: {sorted(COMPUTED)}"


@pytest.mark.parametrize("part", PARTS)
def test_no_part_imports_the_face(part):
    """The face (lightspan.cli, .experiment, .demo, .models, .inference, .runs, .agents) composes the
    parts; a part that imported it would stand on the roof."""
    face = [f"{path.relative_to(ROOT)} imports {name}" for path in part_files(part) for name in imports(path)[0]
            if name.startswith("lightspan.") and name.split(".")[1] not in PARTS]
    assert not face, "\n".join(face)


def _documented() -> dict[str, set[str]]:
    """docs/architecture.md's layering table: part -> the parts it may import."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("| part | may import |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.strip().splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = {p for p in re.findall(r"`([a-z]+)`", cells[1]) if p in PARTS}
    return rows


def test_the_layering_table_is_no_looser_than_the_architecture_doc():
    documented = _documented()
    assert set(documented) == set(PARTS), f"docs/architecture.md's table lists {sorted(documented)}"
    for part, allowed in ALLOWED.items():
        parts = {name.split(".")[1] for name in allowed}
        assert parts <= documented[part], f"{part} may import {sorted(parts - documented[part])} here, not in the doc"


@pytest.mark.parametrize("part", PARTS)
def test_a_part_imports_only_the_parts_below_it(part):
    own = f"lightspan.{part}"
    wrong = []
    for path in part_files(part):
        for name in imports(path)[0]:
            if not name.startswith("lightspan."):
                continue
            if not (covered(name, {own}) or covered(name, ALLOWED[part])):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("part", sorted(THIRD_PARTY))
def test_the_agent_side_and_the_store_import_only_their_libraries(part):
    wrong = []
    for path in part_files(part):
        for name in imports(path)[0]:
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ("lightspan", "__future__") or top in THIRD_PARTY[part]:
                continue
            wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_vllm_is_imported_only_by_the_nccl_sync():
    """lightspan talks to vLLM over HTTP; only the nccl weight sync's data plane (trainer/nccl.py,
    inside functions: importing the trainer loads no vllm) uses vllm's own code."""
    users = {str(path.relative_to(ROOT)) for part in PARTS for path in part_files(part)
             if any(name.split(".")[0] == "vllm" for name in imports(path)[0])}
    assert users == {"trainer/nccl.py"}, users
    tree = ast.parse((ROOT / "trainer" / "nccl.py").read_text())
    top = {a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names} | {
        node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert not {m for m in top if m.split(".")[0] == "vllm"}


def test_the_stores_copy_of_the_vocabulary_is_the_vocabulary():
    """The store imports no other part, so its ``llm_calls`` view holds its own copy of the LLM
    operation names; it must be semconv's, or the view and the builder count different calls."""
    from lightspan.store import views
    from lightspan.tracing import semconv

    assert set(views.LLM_OPERATIONS) == semconv.LLM_OPERATIONS
    assert len(views.LLM_OPERATIONS) == len(semconv.LLM_OPERATIONS)


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
