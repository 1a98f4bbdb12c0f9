"""Virtual environments for agents whose framework cannot share lightspan's environment (crewAI
requires ``openai<3``; AutoGen's core pins ``protobuf~=5.29``): ``pip install -e ROOT[EXTRA]``
into a venv of its own, as a user installs the agent side beside such an agent.

Each is built once per machine and reused (under ``~/.cache/lightspan/agent-envs``, or
``LIGHTSPAN_AGENT_ENVS``), keyed by this checkout's path, the interpreter and the requirements
pyproject.toml gives the agent side and the extra, so a changed pin builds a new one. lightspan is
installed editable: the agent runs this checkout's code. Building needs the package registry
(≈ 35 s for autogen, ≈ 60 s and 1 GB for crewai on this machine).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LIGHTSPAN_AGENT_ENVS", Path.home() / ".cache" / "lightspan" / "agent-envs"))


def _requirements(extra: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"][extra]]


def agent_env(extra: str, timeout_s: float = 1200) -> Path:
    """The Python of a venv with lightspan's agent side and the ``extra``'s packages."""
    key = hashlib.sha256(json.dumps([str(ROOT), sys.version, _requirements(extra)]).encode()).hexdigest()[:12]
    home = CACHE / f"{extra}-{key}"
    python, ready = home / "bin" / "python", home / ".lightspan-ready"
    if ready.is_file():
        return python
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{extra}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # another test session may be building it
        if not ready.is_file():
            shutil.rmtree(home, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(home)], check=True, timeout=120)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[{extra}]"], check=True,
                           timeout=timeout_s)
            ready.write_text(json.dumps(_requirements(extra)))
    return python
