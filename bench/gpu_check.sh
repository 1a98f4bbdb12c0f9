#!/usr/bin/env bash
# GPU check (bench/gpu_check.py): lightspan's trainer step on a ~0.5B Qwen2 with random weights,
# bf16, on one NVIDIA GPU, with no network. Under 10 minutes; writes $OUT/gpu_check.json (or
# bench/gpu_check.json, or --out FILE). --smoke runs a tiny config on the CPU.
#
#   bench/gpu_check.sh                    # from the repository root or anywhere
#   PYTHON=/opt/venv/bin/python bench/gpu_check.sh --steps 20
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then PYTHON="$repo/.venv/bin/python"; else PYTHON="$(command -v python3 || command -v python)"; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1   # nothing may reach a hub
export TOKENIZERS_PARALLELISM=false
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
fi
# 570 s: the whole check stays under 10 minutes even if a step hangs
exec timeout 570 "$PYTHON" "$repo/bench/gpu_check.py" "$@"
