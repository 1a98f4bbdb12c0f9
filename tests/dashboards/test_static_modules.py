"""The web UI's ES modules (dashboards/static/*.js): every import names a module there and names
it exports, and the imports form no cycle (a module in a cycle can run before the one it imports
has defined its exports)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from lightspan.dashboards import web

IMPORT = re.compile(r'^import\s*\{([^}]*)\}\s*from\s*"\./([\w.-]+\.js)";', re.M)
EXPORT = re.compile(r"^export\s+(?:async\s+)?(?:function|const|let|class)\s+(\w+)", re.M)


def graph() -> dict[str, dict[str, set[str]]]:
    """module -> {imported module: the names it imports}."""
    return {p.name: {m.group(2): {n.strip() for n in m.group(1).split(",") if n.strip()}
                     for m in IMPORT.finditer(p.read_text())}
            for p in sorted(web.STATIC_DIR.glob("*.js"))}


def test_every_import_is_an_export_of_a_module_there():
    modules = graph()
    exports = {name: set(EXPORT.findall((web.STATIC_DIR / name).read_text())) for name in modules}
    for module, imports in modules.items():
        for target, names in imports.items():
            assert target in modules, f"{module} imports ./{target}, which is not in dashboards/static"
            assert names <= exports[target], f"{module} imports {sorted(names - exports[target])} from {target}"
    assert len(modules) > 5 and modules["app.js"]


def test_the_modules_form_no_cycle():
    modules = graph()
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for target in modules[module]:
            visit(target)
        path.pop()
        done.add(module)

    for module in modules:
        visit(module)
    reached, todo = set(), ["app.js"]
    while todo:                             # and app.js reaches every module: none is left unused
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += list(modules[module])
    assert reached == set(modules), f"not imported from app.js: {sorted(set(modules) - reached)}"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_each_module_parses():
    for path in sorted(web.STATIC_DIR.glob("*.js")):
        out = subprocess.run(["node", "--check", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, f"{path.name}: {out.stderr}"
