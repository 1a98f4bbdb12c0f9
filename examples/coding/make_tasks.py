"""Write SWE-smith-style tasks for the coding agent: bugs injected into copies of textkit.

    python examples/coding/make_tasks.py        # data/train.jsonl, data/val.jsonl (+ the measured run's subsets)

Each candidate bug is one token changed on one line of ``textkit/textkit/*.py`` (the operators and
constants the ``ast`` finds): an operator swapped (``+``/``-``, ``<``/``<=``, ``>``/``>=``, ``==``/``!=``,
``in``/``not in``, ``and``/``or``) or an integer constant off by one. A candidate becomes a task only
when the clean package passes every shipped test case and the bugged copy fails at least one (checked in
the sandbox, grade.py). Every bug is written in four tiers, easiest first, which differ only in what the
statement says:

- ``fix``: the failing test, the file, the line as it is and the line as it should be;
- ``line``: the failing test, the call, its wrong and expected result, and the file and line;
- ``function``: the failing test, the call and its wrong and expected result;
- ``test``: only that tests fail.

Bugs are split, not tasks: every tier of one bug is in the same split (one bug in four is held out).
A task line: ``id``, ``bug``, ``tier``, ``file``, ``line``, ``original``, ``buggy``, ``failing`` (the
failing tests' ids), ``statement``; the ``command`` tier's also ``command`` (its edit command, checked
with the real ``sed`` on a copy to turn the bugged file back into the clean one).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import grade  # noqa: E402

TIERS = ("command", "fix", "line", "function", "test")
SWAPS = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"),
         ast.Gt: (">", ">="), ast.GtE: (">=", ">"), ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="),
         ast.FloorDiv: ("//", "/"), ast.Mult: ("*", "+")}
RUN_TESTS = "Run the tests with `python3 -m pytest -x`."
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"   # mini.yaml's submit command (mini-swe-agent's phrase)


def mutations(source: str) -> list[tuple[int, str, str]]:
    """(line number, original line, bugged line) for each one-token change the ``ast`` offers."""
    lines = source.splitlines()
    out = []

    def replace(lineno, start, end, old, new):
        line = lines[lineno - 1]
        if line[start:end] == old:
            out.append((lineno, line, line[:start] + new + line[end:]))

    for node in ast.walk(source_tree := ast.parse(source)):
        if isinstance(node, ast.BinOp) and type(node.op) in SWAPS and node.left.end_lineno == node.right.lineno:
            old, new = SWAPS[type(node.op)]
            gap = lines[node.lineno - 1][node.left.end_col_offset:node.right.col_offset]
            if gap.count(old) == 1 and node.lineno == node.left.end_lineno:
                at = node.left.end_col_offset + gap.index(old)
                replace(node.lineno, at, at + len(old), old, new)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and node.lineno == node.comparators[0].lineno:
            op = type(node.ops[0])
            old, new = SWAPS.get(op, ("not in", "in") if op is ast.NotIn else ("in", "not in") if op is ast.In else (None, None))
            if old is None:
                continue
            gap = lines[node.lineno - 1][node.left.end_col_offset:node.comparators[0].col_offset]
            if gap.strip() == old:
                at = node.left.end_col_offset + gap.index(old)
                replace(node.lineno, at, at + len(old), old, new)
        elif isinstance(node, ast.BoolOp) and node.lineno == node.end_lineno:
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            a, b = node.values[0], node.values[1]
            gap = lines[node.lineno - 1][a.end_col_offset:b.col_offset]
            if gap.strip() == old:
                at = a.end_col_offset + gap.index(old)
                replace(node.lineno, at, at + len(old), old, new)
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.lineno == node.end_lineno:
            for new in (node.value + 1, node.value - 1):
                if new >= 0:
                    replace(node.lineno, node.col_offset, node.end_col_offset, str(node.value), str(new))
    del source_tree
    return sorted(set(out))


def bugged_copy(root: Path, module: str, lineno: int, original: str, buggy: str) -> None:
    """Rewrite one line of ``root/textkit/<module>`` (a copy of the clean package)."""
    path = root / "textkit" / module
    lines = path.read_text().split("\n")
    if lines[lineno - 1] != original:
        raise ValueError(f"{path}:{lineno} is {lines[lineno - 1]!r}, not the task's original line {original!r}")
    lines[lineno - 1] = buggy
    path.write_text("\n".join(lines))


def _sed_escape(text: str, replacement: bool) -> str:
    return re.sub(r"([\\/&])" if replacement else r"([\\/.*\[\]^$])", r"\\\1", text)


def edit_command(rel: str, lineno: int, original: str, buggy: str) -> str:
    """The one-line ``sed -i`` that turns the bugged line back into the original: the changed characters
    with the token on each side (more while the snippet is not unique on the line), e.g.
    ``sed -i '38s/== 1:/== 0:/' textkit/case.py``."""
    head = 0
    while head < min(len(original), len(buggy)) and original[head] == buggy[head]:
        head += 1
    tail = 0
    while tail < min(len(original), len(buggy)) - head and original[-1 - tail] == buggy[-1 - tail]:
        tail += 1
    lo, hi = head, len(buggy) - tail
    if hi <= lo:                     # a deletion: the characters on both sides of it
        lo, hi = lo - 1, lo + 1
    tokens = [m.span() for m in re.finditer(r"\w+|[^\w\s]+", buggy)]
    changed = [i for i, (a, b) in enumerate(tokens) if a < hi and b > lo]
    first, last = (changed[0], changed[-1]) if changed else (0, len(tokens) - 1)
    for widen in range(1, len(tokens) + 1):
        a, b = tokens[max(0, first - widen)][0], tokens[min(len(tokens) - 1, last + widen)][1]
        if buggy.count(buggy[a:b]) == 1:
            break
    old, new = buggy[a:b], original[a:len(original) - (len(buggy) - b)]
    script = f"{lineno}s/{_sed_escape(old, False)}/{_sed_escape(new, True)}/"
    return f"sed -i {shlex.quote(script)} {rel}"


def check_command(command: str, root: Path, rel: str, clean: str) -> None:
    """Run the edit command with the real sed in ``root`` (a bugged copy): the file must become ``clean``."""
    subprocess.run(["bash", "-c", command], cwd=root, check=True, capture_output=True)
    if (root / rel).read_text() != clean:
        raise ValueError(f"{command!r} does not restore {rel}")


def statement(tier: str, rel: str, lineno: int, original: str, buggy: str, failing: str, call: str,
              got: str, expected: str) -> str:
    if tier == "command":
        return (f"The test {failing} fails. Fix it with the command below, then submit with the command: {SUBMIT}"
                f"\n\n```bash\n{edit_command(rel, lineno, original, buggy)}\n```")
    if tier == "fix":
        return (f"The test {failing} fails. In {rel}, line {lineno} is:\n    {buggy.strip()}\n"
                f"It should be:\n    {original.strip()}\nFix that line. {RUN_TESTS}")
    if tier == "line":
        return (f"The test {failing} fails: {call} returns {got}, expected {expected}. "
                f"The bug is on line {lineno} of {rel}. {RUN_TESTS}")
    if tier == "function":
        return f"The test {failing} fails: {call} returns {got}, expected {expected}. {RUN_TESTS}"
    return f"Some tests in tests/test_textkit.py fail. Find the bug in the textkit package and fix it. {RUN_TESTS}"


def make_tasks(work: Path, every_val: int = 4) -> tuple[list[dict], list[dict]]:
    import shutil

    visible = grade.visible_cases()
    calls = [(name, args) for name, args, _ in visible]
    ids = grade.case_ids(visible)
    clean = grade.run_calls(grade.PRISTINE, calls)
    assert isinstance(clean, list) and [r.get("ok") for r in clean] == [e for _, _, e in visible], \
        "the clean package fails its own tests"
    bugs = []
    for path in sorted((grade.PRISTINE / "textkit").glob("*.py")):
        for lineno, original, buggy in mutations(path.read_text()):
            copy = work / f"bug-{len(bugs)}"
            shutil.copytree(grade.PRISTINE, copy)
            bugged_copy(copy, path.name, lineno, original, buggy)
            results = grade.run_calls(copy, calls)
            if isinstance(results, list):
                check_command(edit_command(f"textkit/{path.name}", lineno, original, buggy), copy,
                              f"textkit/{path.name}", path.read_text())
            shutil.rmtree(copy)
            if not isinstance(results, list):
                continue   # the bug breaks the import or hangs: not one failing test
            failing = [i for i, (r, (_, _, e)) in enumerate(zip(results, visible)) if r.get("ok", object()) != e]
            if not failing:
                continue   # an equivalent mutant
            first = failing[0]
            name, args, expected = visible[first]
            got = results[first]
            got_text = repr(got["ok"]) if "ok" in got else f"an error ({got['error']})"
            call = f"textkit.{name}({', '.join(map(repr, args))})"
            bugs.append({"file": f"textkit/{path.name}", "line": lineno, "original": original, "buggy": buggy,
                         "failing": [ids[i] for i in failing], "call": call, "got": got_text,
                         "expected": repr(expected)})
    train, val = [], []
    for b, bug in enumerate(bugs):
        for tier in TIERS:
            text = statement(tier, bug["file"], bug["line"], bug["original"], bug["buggy"], bug["failing"][0],
                             bug["call"], bug["got"], bug["expected"])
            task = {"id": f"bug{b:03d}-{tier}", "bug": b, "tier": tier,
                    **{k: bug[k] for k in ("file", "line", "original", "buggy", "failing")}, "statement": text}
            if tier == "command":
                task["command"] = edit_command(bug["file"], bug["line"], bug["original"], bug["buggy"])
            (val if b % every_val == every_val - 1 else train).append(task)
    return train, val


def run_splits(train: list[dict], val: list[dict]) -> dict[str, list[dict]]:
    """The measured training run's task files (README, "Run it"): training on the ``command`` tier, the
    only one SmolLM2-135M solves sometimes; held out, 8 ``command`` tasks and 4 ``fix`` tasks (whether
    anything carries over to the next tier)."""
    def tier(rows: list[dict], name: str) -> list[dict]:
        return [r for r in rows if r["tier"] == name]
    return {"train-command": tier(train, "command"), "val-run": tier(val, "command")[:8] + tier(val, "fix")[:4]}


def main(argv=None) -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(HERE / "data"), help="directory for train.jsonl and val.jsonl")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        train, val = make_tasks(Path(work))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("val", val), *run_splits(train, val).items()):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"train": len(train), "val": len(val), "bugs": len({t["bug"] for t in train + val})}))


if __name__ == "__main__":
    main()
