#!/usr/bin/env bash
# What the untrained policy solves, per tier: held-out tasks through `lightspan rollout` (mini-swe-agent as
# agent.py runs it, every call captured), then bench/tiers.py. Starts a collector and vLLM (SmolLM2-135M,
# served as 'policy', --max-model-len 4096 as the experiment) on ports of its own and stops both at the end.
#
#   heavy-slot --slot B nice bash examples/coding/measure.sh OUT.json command:0.7:16 command:0:8
#
# Each argument TIER:TEMPERATURE:N runs the first N held-out tasks of TIER (data/val.jsonl) once each at
# that temperature; temperature 0 is stored as split 'val', any other as 'train' (bench/tiers.py groups by
# split and tier). CODING_MEASURE_VLLM_URL: use a running vLLM instead of starting one. CODING_CONFIG
# (agent.py's) picks another mini-swe-agent config. The data directory (a mktemp under /tmp) is removed
# at the end unless CODING_MEASURE_KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$1; shift
py=${PYTHON:-.venv/bin/python}
model=${CODING_MEASURE_MODEL:-$HOME/.cache/lightspan/models/smollm2-135m-instruct}
port=${CODING_MEASURE_PORT:-8710}
data=$(mktemp -d /tmp/coding-measure.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ "${CODING_MEASURE_KEEP:-0}" = 1 ] || rm -rf "$data"
}
trap cleanup EXIT
trap 'exit 143' TERM INT
wait_for() {   # URL SECONDS
  for _ in $(seq "$2"); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
  echo "measure.sh: $1 did not answer in $2 s" >&2; return 1
}

setsid "$py" -m lightspan.cli collector --data-dir "$data" --grpc-port 0 --http-port $((port + 1)) \
  --api-port $((port + 2)) >"$data/collector.log" 2>&1 &
pids+=($!)
vllm=${CODING_MEASURE_VLLM_URL:-}
if [ -z "$vllm" ]; then
  setsid "$py" -m lightspan.cli vllm --model "$model" --port "$port" --max-model-len 4096 >"$data/vllm.log" 2>&1 &
  pids+=($!)
  vllm=http://127.0.0.1:$port
  wait_for "$vllm/health" 600
fi
wait_for "http://127.0.0.1:$((port + 2))/healthz" 60
start=$(date +%s)
for spec in "$@"; do
  IFS=: read -r tier temp n <<<"$spec"
  split=$([ "$temp" = 0 ] && echo val || echo train)
  tasks=$data/tasks-$tier-$temp.jsonl
  "$py" -c 'import json, sys
rows = [json.loads(l) for l in open("examples/coding/data/val.jsonl")]
picked = [r for r in rows if r["tier"] == sys.argv[1]][:int(sys.argv[3])]
print("".join(json.dumps({**r, "temperature": float(sys.argv[2])}) + "\n" for r in picked), end="")' \
    "$tier" "$temp" "$n" >"$tasks"
  "$py" -m lightspan.cli rollout --tasks "$tasks" --samples 1 --concurrency 8 --split "$split" \
    --data-dir "$data" --otlp-endpoint "http://127.0.0.1:$((port + 1))" \
    --collector-api-url "http://127.0.0.1:$((port + 2))" --openai-base-url "$vllm/v1" --timeout-s 900 \
    -- unshare --mount --propagation private python examples/coding/agent.py | tail -1
done
curl -sf -X POST "http://127.0.0.1:$((port + 2))/v1/flush" >/dev/null
"$py" bench/tiers.py --data-dir "$data" --tasks examples/coding/data/val.jsonl --fields cpu_s,exit_status | "$py" -c 'import json, sys
s = json.load(sys.stdin)
s.update(runs=sys.argv[2:], wall_s=int(sys.argv[1]), config=__import__("os").environ.get("CODING_CONFIG", "mini.yaml"))
print(json.dumps(s, indent=1))' "$(($(date +%s) - start))" "$@" >"$out"
cat "$out"
