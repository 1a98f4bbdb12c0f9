#!/usr/bin/env bash
# Set everything up, then run the whole test suite (real collector, real vLLM, tiny model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
