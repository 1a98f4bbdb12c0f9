"""The reward of a coding rollout: does the agent's copy of textkit behave like the clean package?

    result = grade(copy_dir)          # {"passed": bool, "failed": [...], "cases": N, ...}

The agent's code is never imported here: its ``textkit/*.py`` files are written into a fresh bubblewrap
sandbox (examples/sandbox/sandbox.py: no network, its own filesystem, CPU, memory and time limits) with a
small driver that calls each function on the test inputs and prints the results. Only the **inputs** go
into that sandbox; the expected results stay in this process, which compares. So the agent's code can
only influence its own outputs: printing, exiting 0, editing or deleting the tests in its copy, or
patching pytest gain it nothing. The cases are the shipped tests' (``textkit/tests/cases.py``, read from
the clean package, never from the copy) plus held-back inputs (``hidden_cases.py``) whose expected
results come from the clean package, so memorising the visible cases fails too.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRISTINE = HERE / "textkit"


def _sandbox_module():
    """examples/sandbox/sandbox.py, shared with the sandbox example (loaded by path: both examples have a
    make_tasks.py, so neither folder goes on sys.path)."""
    name = "lightspan_examples_sandbox"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE.parent / "sandbox" / "sandbox.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


sandbox = _sandbox_module()
Sandbox, SandboxConfig, SandboxUnavailable = sandbox.Sandbox, sandbox.SandboxConfig, sandbox.SandboxUnavailable

MAX_SOURCE_BYTES = 256 * 1024
"""A larger module in the agent's copy is graded as missing (the sandbox's disk is small)."""
MARK = "TEXTKIT-RESULTS "

DRIVER = """
import json, os, sys
os.makedirs("/sandbox/pkg/textkit")
for name, text in SOURCES.items():
    with open("/sandbox/pkg/textkit/" + name, "w") as f:
        f.write(text)
sys.path.insert(0, "/sandbox/pkg")
out = []
try:
    import textkit
except BaseException as e:
    print(MARK + json.dumps({"import_error": type(e).__name__ + ": " + str(e)[:200]}))
    raise SystemExit(0)
for name, args in CALLS:
    try:
        out.append({"ok": json.loads(json.dumps(getattr(textkit, name)(*args)))})
    except BaseException as e:
        out.append({"error": type(e).__name__ + ": " + str(e)[:200]})
print(MARK + json.dumps(out))
"""


def visible_cases(pristine: Path = PRISTINE) -> list[tuple[str, list, object]]:
    """(function, arguments, expected) of the shipped tests, read from the clean package."""
    cases = runpy.run_path(str(pristine / "tests" / "cases.py"))["CASES"]
    return [(name, list(args), json.loads(json.dumps(expected))) for name, rows in cases.items() for args, expected in rows]


def hidden_calls() -> list[tuple[str, list]]:
    hidden = runpy.run_path(str(HERE / "hidden_cases.py"))["HIDDEN"]
    return [(name, list(args)) for name, rows in hidden.items() for args in rows]


def sources(package_dir: Path) -> dict[str, str]:
    """The ``textkit/*.py`` files of a copy (``package_dir`` holds ``textkit/``), bounded in size."""
    out = {}
    for path in sorted((package_dir / "textkit").glob("*.py")):
        if path.is_file() and not path.is_symlink() and path.stat().st_size <= MAX_SOURCE_BYTES:
            out[path.name] = path.read_text(errors="replace")
    return out


def sandbox_config() -> SandboxConfig:
    cfg = SandboxConfig.from_env()
    return SandboxConfig(**{**cfg.__dict__, "output_bytes": max(cfg.output_bytes, 1 << 20),
                            "wall_s": max(cfg.wall_s, 20.0)})


def run_calls(package_dir: Path, calls: list[tuple[str, list]], box: Sandbox | None = None) -> list[dict] | dict:
    """Each call's result (``{"ok": value}`` or ``{"error": text}``) on the copy's code, in a fresh
    sandbox; ``{"import_error": ...}`` or ``{"sandbox": ...}`` when no call could run."""
    box = box or Sandbox(sandbox_config())
    program = (f"SOURCES = {sources(package_dir)!r}\nCALLS = {calls!r}\nMARK = {MARK!r}\n" + DRIVER)
    result = box.run(program)
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        return {"sandbox": f"no results (exit {result.exit_code}, limit {result.limit}): {result.stderr.strip()[-300:]}"}
    try:
        out = json.loads(lines[-1][len(MARK):])
    except json.JSONDecodeError:
        return {"sandbox": "unreadable results"}
    if isinstance(out, list) and len(out) != len(calls):
        return {"sandbox": f"{len(out)} results for {len(calls)} calls"}
    return out


@functools.lru_cache(maxsize=1)
def _hidden_expected() -> tuple:
    calls = hidden_calls()
    results = run_calls(PRISTINE, calls)
    if not isinstance(results, list) or any("ok" not in r for r in results):
        raise RuntimeError(f"the clean package failed its held-back inputs: {results}")
    return tuple(json.dumps(r["ok"]) for r in results)


def grade(package_dir: Path, box: Sandbox | None = None) -> dict:
    """Whether every shipped test case and every held-back input gives the clean package's result."""
    visible = visible_cases()
    hidden = hidden_calls()
    calls = [(name, args) for name, args, _ in visible] + hidden
    expected = [json.dumps(e) for _, _, e in visible] + list(_hidden_expected())
    results = run_calls(package_dir, calls, box)
    if isinstance(results, dict):
        return {"passed": False, "cases": len(calls), "failed": len(calls), "error": next(iter(results.values())),
                "failed_visible": [], "failed_hidden": []}
    failed = [i for i, (r, e) in enumerate(zip(results, expected)) if "ok" not in r or json.dumps(r["ok"]) != e]
    ids = case_ids(visible)
    return {"passed": not failed, "cases": len(calls), "failed": len(failed),
            "failed_visible": [ids[i] for i in failed if i < len(visible)],
            "failed_hidden": [f"{calls[i][0]}{tuple(calls[i][1])!r}" for i in failed if i >= len(visible)]}


def case_ids(visible) -> list[str]:
    """pytest's ids of the shipped cases (tests/test_textkit.py): ``test_case[slugify-0]``."""
    seen: dict[str, int] = {}
    ids = []
    for name, _, _ in visible:
        ids.append(f"test_case[{name}-{seen.get(name, 0)}]")
        seen[name] = seen.get(name, 0) + 1
    return ids


if __name__ == "__main__":   # python examples/coding/grade.py DIR: grade a copy (DIR holds textkit/)
    print(json.dumps(grade(Path(sys.argv[1] if len(sys.argv) > 1 else PRISTINE)), indent=1))
