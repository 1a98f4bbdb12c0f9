"""What the benchmarks that run real vLLM servers side by side share (bench/lora_serving.py,
bench/vllm_reader_spin.py): free ports, the servers started and stopped, per-arm medians of rows."""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from pathlib import Path

from lightspan import inference


@contextmanager
def servers(cfgs: dict, work: Path):
    """Each ``inference.VLLMConfig`` of ``cfgs`` served (started at once, then each waited for; its
    log ``work/vllm-ARM.log``), yielding arm -> process; all stopped on the way out."""
    procs = {}
    try:
        for arm, cfg in cfgs.items():
            procs[arm] = inference.start(cfg, work / f"vllm-{arm}.log")
        for arm, cfg in cfgs.items():
            inference.wait_healthy(cfg.url, procs[arm], cfg.startup_timeout_s, work / f"vllm-{arm}.log")
        yield procs
    finally:
        for proc in procs.values():
            inference.stop(proc)


def medians(rows: dict, keys=("cpu_s", "wall_s", "tokens")) -> dict:
    """arm -> key -> the median of that arm's rows."""
    return {arm: {k: statistics.median(r[k] for r in rs) for k in keys} for arm, rs in rows.items()}
