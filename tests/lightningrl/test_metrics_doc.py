"""Every ``transitions/*`` metric a build returns is explained in docs/metrics.md."""

from __future__ import annotations

from pathlib import Path

from .helpers import build, episode, write

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def explained(key: str, doc: str) -> bool:
    """``key`` in backticks, or its family (``transitions/dropped_rollouts/<reason>``) with its last
    part named in backticks."""
    if f"`{key}`" in doc:
        return True
    family, _, last = key.rpartition("/")
    return f"`{family}/<" in doc and f"`{last}`" in doc


def test_every_build_metric_is_explained(tmp_path):
    write(tmp_path, episode("a", 1.0, calls=2) + episode("b", 0.0))
    _, metrics = build(tmp_path)
    doc = DOC.read_text().split("## Transition builder metrics", 1)[1].split("\n## ", 1)[0]
    missing = sorted(k for k in metrics if not explained(k, doc))
    assert not missing, f"docs/metrics.md does not explain {missing}"
    assert len(metrics) > 30
