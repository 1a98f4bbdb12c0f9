"""The ``openai`` releases agents use: 1.x (from 1.67: 1.66 had the Responses API but no
``usage.input_tokens_details``, and traceloop's instrumentation 0.62.4 then raises on every
Responses answer whose prompt vLLM found in its prefix cache), 2.x (crewAI
needs ``openai<3``) and 3.x (this environment's). For the two older lines a throwaway virtual
environment is built under pytest's tmp dir (``pip install openai==X`` and lightspan's agent side:
about 30 s each, made once per session), and tests/tracing/openai_version_calls.py makes one call
of each shape there against the session's real vLLM, through the recording proxy: the spans must
hold what vLLM returned, and the client see what it sees without lightspan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tracing.test_frameworks import vllm_returned
from tests.tracing.test_protocols import _exchanges

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ["1.67.0", "2.54.0"]   # the oldest supported, the newest of the 2.x line


@pytest.fixture(scope="session")
def venvs(tmp_path_factory):
    made = {}

    def venv(version: str) -> Path:
        if version not in made:
            path = tmp_path_factory.mktemp(f"openai-{version}")
            subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
            pip = subprocess.run([str(path / "bin" / "pip"), "install", "-q", f"openai=={version}", str(ROOT)],
                                 capture_output=True, text=True, timeout=900)
            assert pip.returncode == 0, pip.stderr[-3000:]
            made[version] = path / "bin" / "python"
        return made[version]
    return venv


@pytest.mark.parametrize("version", VERSIONS)
def test_an_older_openai_is_captured(version, venvs, recorder, tmp_path):
    python = venvs(version)
    recorder.clear()
    env = {**os.environ, "OPENAI_BASE_URL": f"{recorder.url}/v1", "OPENAI_API_KEY": "x"}
    env.pop("LIGHTSPAN_CAPTURE_URLS", None)
    run = subprocess.run([str(python), str(ROOT / "tests/tracing/openai_version_calls.py")], env=env,
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["openai"] == version
    # the caller saw no logprobs and no ids it did not ask for; raw and async streams worked
    assert out["seen"] == [True, True, True, True, True, "response.completed"]
    exchanges = _exchanges(recorder, 6)
    # the Responses calls too go as chat completions (1.x leaves NOT_GIVEN in the body it posts: not a field)
    assert [path for path, *_ in exchanges] == ["/v1/chat/completions"] * 6
    assert [sent.get("max_tokens") for _, sent, *_ in exchanges[4:]] == [4, 4]
    spans = out["spans"]
    returned = [vllm_returned(e) for e in exchanges]
    assert [(tuple(s["prompt"]), tuple(s["completion"][0])) for s in spans] == [r[:2] for r in returned]
    assert [s["status"] for s in spans] == ["ok"] * 6   # a logprob per token, streamed Responses too
