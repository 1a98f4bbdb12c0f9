"""Every Sphinx-style reference in the package's docstrings and comments (``:func:``, ``:meth:``,
``:class:``, ``:mod:``, ``:data:``, ``:attr:``, ``:exc:``) names something that exists: a module
that imports, a name in it, or a method or attribute of a class of the module it is written in."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("core", "store", "collector", "tracing", "rollout", "lightningrl", "trainer", "dashboards", "lightspan")
ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc|obj):`~?([^`<]+?)(?:\s*<([^>]+)>)?`")


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[1:] if parts[0] == "lightspan" else parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("lightspan", *parts))


def found(dotted: str) -> bool:
    """``dotted`` is a module, or a chain of attributes from the longest module prefix that imports."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def declared(name: str, text: str) -> bool:
    """An instance attribute the module's code sets (``self.name =``) or a class annotates."""
    return re.search(rf"self\.{name}\s*[:=]", text) is not None or re.search(rf"^\s+{name}\s*:", text, re.M) is not None


def resolves(target: str, module: str, text: str) -> bool:
    target = re.sub(r"\s+", "", target).removesuffix("()")
    if target.startswith("."):          # relative to the module's package
        dots = len(target) - len(target.lstrip("."))
        package = module if (ROOT / Path(*module.split(".")[1:]) / "__init__.py").exists() else module.rpartition(".")[0]
        base = package.split(".")[:len(package.split(".")) - (dots - 1)]
        return found(".".join([*base, target.lstrip(".")]))
    package = module.rpartition(".")[0]
    if any(found(c) for c in (target, f"{module}.{target}", f"{package}.{target}")):
        return True
    head, _, name = target.rpartition(".")
    if head:                             # Class.attribute of this module, set on instances
        return found(f"{module}.{head}") and declared(name, text)
    # a bare method or attribute name: of a class of this module
    mod = importlib.import_module(module)
    classes = [c for c in vars(mod).values() if isinstance(c, type) and c.__module__ == mod.__name__]
    return any(hasattr(c, name) for c in classes) or declared(name, text)


FILES = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py")) if ROLE.search(p.read_text())]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_references_resolve(path):
    text = path.read_text()
    module = module_of(path)
    wrong = [f"line {text[:m.start()].count(chr(10)) + 1}: {m.group(0)}" for m in ROLE.finditer(text)
             if not resolves(m.group(2) or m.group(1), module, text)]
    assert not wrong, f"{path.relative_to(ROOT)} cites what does not exist:\n" + "\n".join(wrong)


def test_the_check_finds_a_dangling_reference():
    text = "x"
    assert not resolves("Writer.sync", "lightspan.collector.writer", text)
    assert not resolves("lightspan.services", "lightspan.core.web", text)
    assert resolves("lightspan.collector.wal.WAL.sync", "lightspan.collector.writer", text)
    assert resolves(".credit", "lightspan.lightningrl.assignment", text)
    assert resolves("enqueue", "lightspan.collector.writer", text)
