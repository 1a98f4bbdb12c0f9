#!/usr/bin/env bash
# Set everything up, then run the end-to-end demo (about 15 minutes on 2 CPU cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/lightspan demo "$@"
