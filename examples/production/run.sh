#!/usr/bin/env bash
# examples/production: the README's stages as one script (the measured runs use it).
#
#   bash examples/production/run.sh hosted sft        # (a) then (b)
#   bash examples/production/run.sh rl                # (c) + (d), on the same data directory (after sft)
#   python examples/production/measure.py --out OUT/cost.json -- bash examples/production/run.sh hosted sft rl
#                                                     # the whole run, with its wall and CPU time
#
# Every service it starts is stopped when it exits. Ports, directories and sizes are variables below
# (set them in the environment to change them); the README explains each command.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=examples/production
PY=${PY:-.venv/bin/python}
LS="$PY -m lightspan.cli"
MODEL=${MODEL:-$HOME/.cache/lightspan/models/smollm2-135m-instruct}
DATA=${DATA:-/tmp/production-run}                   # the lightspan data directory
OUT=${OUT:-$HERE/results/seed${SEED:-0}}            # small summaries: per-hour rewards, decisions, timings
LOGS=${LOGS:-$DATA/logs}                            # the services' logs and every request and feedback
SEED=${SEED:-0}
HOURS=${HOURS:-8}; RPH=${RPH:-40}; SHARE=${SHARE:-0.5}
EVAL_HOURS=${EVAL_HOURS:-4}                         # simulated hours of the base and SFT policies' traffic
# SFT: two passes over the rewarded hosted calls, 8 calls a step (README, "Measured": why these)
SFT_EPOCHS=${SFT_EPOCHS:-2}; SFT_BATCH=${SFT_BATCH:-8}; SFT_LR=${SFT_LR:-1e-3}
RL_LR=${RL_LR:-3e-4}; BAD_LR=${BAD_LR:-3e-2}                # the bad version: 100x the learning rate
OTLP_PORT=${OTLP_PORT:-4318}; GRPC_PORT=${GRPC_PORT:-4317}; API_PORT=${API_PORT:-8321}
VLLM_PORT=${VLLM_PORT:-8000}; GATEWAY_PORT=${GATEWAY_PORT:-8100}
SERVICE_PORT=${SERVICE_PORT:-8200}; STANDIN_PORT=${STANDIN_PORT:-8300}
API=http://127.0.0.1:$API_PORT
mkdir -p "$DATA" "$OUT" "$LOGS"
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait' EXIT

wait_up() {  # URL: until it answers (a service starting)
  for _ in $(seq 600); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
  echo "run.sh: $1 did not come up" >&2; return 1
}

collector() {
  $LS collector --data-dir "$DATA" --grpc-port "$GRPC_PORT" --http-port "$OTLP_PORT" --api-port "$API_PORT" \
    >"$LOGS/collector.log" 2>&1 & PIDS+=($!)
  wait_up "$API/healthz"
}

service() {  # BASE_URL MODEL: the order assistant, traced into the collector by configuration alone
  OPENAI_BASE_URL=$1 OPENAI_API_KEY=x AGENT_MODEL=$2 \
  OTEL_SERVICE_NAME=order-assistant OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$OTLP_PORT \
  OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf OTEL_RESOURCE_ATTRIBUTES=lightspan.task.id=order_total \
  LIGHTSPAN_CAPTURE_URLS=none OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=langchain \
    .venv/bin/opentelemetry-instrument "$PY" $HERE/service.py --port "$SERVICE_PORT" \
    >>"$LOGS/service.log" 2>&1 & SERVICE_PID=$!; PIDS+=($SERVICE_PID)
  wait_up "http://127.0.0.1:$SERVICE_PORT/healthz"
}

traffic() {  # NAME K [more flags]: simulated users (seed SEED*10+K: new questions each stage); $LOGS/NAME.jsonl
  local name=$1 k=$2; shift 2
  "$PY" $HERE/traffic.py --service-url "http://127.0.0.1:$SERVICE_PORT" --collector-url "$API" \
    --seed $((SEED * 10 + k)) \
    --hours "$HOURS" --requests-per-hour "$RPH" --feedback-share "$SHARE" --out "$LOGS/$name.jsonl" "$@" \
    | tee "$OUT/$name.hours.jsonl"
}

vllm() {  # SmolLM2 with LoRA serving: the base as policy-base, each trained version as policy(-vN)
  $LS vllm --model "$MODEL" --port "$VLLM_PORT" --lora-rank 16 --seed "$SEED" >"$LOGS/vllm.log" 2>&1 & PIDS+=($!)
  wait_up "http://127.0.0.1:$VLLM_PORT/v1/models"
}

gateway() {  # [CONFIG]: token ids for every call, canaries with a config that enables them
  $LS gateway ${1:+--config "$1"} --upstream "http://127.0.0.1:$VLLM_PORT" --port "$GATEWAY_PORT" \
    --data-dir "$DATA" --otlp-endpoint "http://127.0.0.1:$GRPC_PORT" --collector-api-url "$API" \
    >>"$LOGS/gateway.log" 2>&1 & GATEWAY_PID=$!; PIDS+=($GATEWAY_PID)
  wait_up "http://127.0.0.1:$GATEWAY_PORT/health"
}

stop() { kill "$1"; wait "$1" 2>/dev/null || true; }

BUILD=(--data-dir "$DATA" --group-by batch --min-group-size 8 --min-model-version 1)
build() {  # RL's transitions: the rewarded requests of the trained versions (not SmolLM2 as it came, version 0)
  $LS transitions build "${BUILD[@]}" >>"$LOGS/transitions.log" 2>&1
}

mark() {  # EVENT [JSON fields]: $OUT/timings.jsonl, the wall-clock time of each step of the run
  echo "{\"event\": \"$1\", \"t\": $(date +%s.%N | cut -c1-14)${2:+, $2}}" >>"$OUT/timings.jsonl"
}

version() {  # the policy version training published last (policy.json), -1 before any
  "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["version"])' "$DATA/policy.json" 2>/dev/null || echo -1
}

decided() {  # VERSION: wait (at most 5 minutes) until the canary promoted or rolled back VERSION
  for _ in $(seq 60); do
    curl -sf -X POST "$API/v1/flush" >/dev/null || true
    n=$($LS sql --data-dir "$DATA" --format csv "SELECT count(*) FROM deployments WHERE version = $1
          AND action IN ('promote', 'rollback')" 2>/dev/null | tail -1)
    [ "${n:-0}" -gt 0 ] && return 0
    sleep 5
  done
  echo "run.sh: no canary decision on version $1 within 5 minutes of its traffic's end" >&2
}

# one torch thread: on a machine whose cores vLLM and the services share, torch's second OpenMP thread
# waits at every matmul's barrier for the one that was descheduled (README, "Measured": the SFT of 114
# calls ran 26 minutes on two threads, mostly in gomp_team_barrier_wait_end)
TRAIN=(--data-dir "$DATA" --model "$MODEL" --vllm-url "http://127.0.0.1:$VLLM_PORT"
       --sync lora --lora-r 16 --seed "$SEED")
THREADS=(--torch-threads "${TORCH_THREADS:-1}")     # the RL trainer's, beside the users' traffic on vLLM
SFT_THREADS=(--torch-threads "${SFT_THREADS:-2}")   # the SFT's: no traffic then, vLLM idle
# the hosted model's rewarded calls; a fifth of the requests (by a hash of the request) held out
HOSTED="request_model = 'hosted-model' AND human_reward IS NOT NULL"
SELECT="$HOSTED AND human_reward >= 1 AND hash(rollout_key) % 5 <> 0"
VAL_SELECT="$HOSTED AND human_reward >= 1 AND hash(rollout_key) % 5 = 0"

for stage in "$@"; do
  case $stage in
    hosted)   # (a) the service on the hosted model (stand-in); users and their feedback
      collector
      "$PY" $HERE/hosted_standin.py --port "$STANDIN_PORT" >"$LOGS/standin.log" 2>&1 & PIDS+=($!)
      wait_up "http://127.0.0.1:$STANDIN_PORT/v1/models"
      service "http://127.0.0.1:$STANDIN_PORT/v1" hosted-model
      mark hosted_traffic; traffic hosted 0
      stop "$SERVICE_PID"; mark hosted_done ;;
    sft)      # (b) SmolLM2 as it comes, then SFT on the rewarded hosted calls, then the same users again
      mark sft_start
      [ -n "${GATEWAY_PID:-}" ] || { curl -sf "$API/healthz" >/dev/null || collector; vllm; gateway; }
      service "http://127.0.0.1:$GATEWAY_PORT/v1" policy-base
      mark base_traffic; traffic base 1 --hours "$EVAL_HOURS"
      stop "$SERVICE_PID"; mark sft_train
      $LS train --algo sft --mode once "${TRAIN[@]}" "${SFT_THREADS[@]}" --learning-rate "$SFT_LR" --batch-size "$SFT_BATCH" \
        --sft-epochs "$SFT_EPOCHS" --select "$SELECT" --val-select "$VAL_SELECT" 2>&1 | tee "$LOGS/sft.log"
      cp "$DATA"/checkpoints/v*/sft_summary.json "$OUT/" 2>/dev/null || true
      mark sft_traffic "\"version\": $(version)"
      service "http://127.0.0.1:$GATEWAY_PORT/v1" policy
      traffic sft 2 --hours "$EVAL_HOURS"
      stop "$SERVICE_PID"; mark sft_done ;;
    rl)       # (c) scheduled RL on the live traffic and its late feedback; (d) each new version a canary
      mark rl_start
      [ -z "${GATEWAY_PID:-}" ] || stop "$GATEWAY_PID"
      curl -sf "$API/healthz" >/dev/null || collector
      curl -sf "http://127.0.0.1:$VLLM_PORT/v1/models" >/dev/null || vllm
      gateway $HERE/gateway.toml
      service "http://127.0.0.1:$GATEWAY_PORT/v1" policy
      build                  # the SFT policy's rewarded requests: the first step's data
      # then transitions as the feedback arrives: a build every 30 s (SIGTERM stops it after the current one)
      $LS transitions build "${BUILD[@]}" --every 30s >>"$LOGS/transitions.log" 2>&1 & BUILDS_PID=$!; PIDS+=($BUILDS_PID)
      # a version every EVERY: 4 simulated hours at 60 s an hour, about what a canary's decision takes
      # (20 rewarded requests per arm at half of 40 an hour, half of them rated 0.5 to 3 hours late),
      # so that a candidate is mostly decided before the next one supersedes it; --hold-while-canary (the
      # default, explicit here): a round trains nothing while the latest version's canary is undecided
      # --verify-sync false: the sync check's prompt_logprobs request, batched with the users' requests
      # on a LoRA adapter, kills vLLM's CPU engine (docs/architecture.md, "einsum(): subscript b")
      $LS train --mode every --every "${EVERY:-4m}" "${TRAIN[@]}" "${THREADS[@]}" --learning-rate "$RL_LR" --min-transitions 8 \
        --verify-sync false --hold-while-canary true >"$LOGS/train.log" 2>&1 & TRAIN_PID=$!; PIDS+=($TRAIN_PID)
      mark rl_traffic; traffic rl 3 --hours "${RL_HOURS:-8}" --seconds-per-hour "${SECONDS_PER_HOUR:-60}"
      stop "$TRAIN_PID"; mark bad_train
      # (d) the bad version: one step at 100x the learning rate on what is left (the feedback that came
      # after the scheduled trainer's last step, built now); the canary must roll it back
      # (--hold-while-canary false: it is published even while the last scheduled version's canary runs)
      stop "$BUILDS_PID"                                     # one build at a time: the scheduled one ends first
      before=$(version)
      build
      $LS train --mode once "${TRAIN[@]}" "${THREADS[@]}" --learning-rate "$BAD_LR" --min-transitions 1 --hold-while-canary false \
        >"$LOGS/bad.log" 2>&1
      bad=$(version)
      [ "$bad" -gt "$before" ] || { echo "run.sh: the bad version was not trained ($LOGS/bad.log says why)" >&2; exit 1; }
      mark bad_traffic "\"version\": $bad"
      traffic bad 4 --hours "${BAD_HOURS:-5}" --seconds-per-hour "${SECONDS_PER_HOUR:-60}"
      decided "$bad"; mark bad_done "\"version\": $bad"
      $LS deploy list --data-dir "$DATA" | tee "$OUT/deployments.txt"
      $LS sql --data-dir "$DATA" --format json "SELECT time_unix_nano, action, version, actor, candidate_rollouts,
        serving_rollouts, candidate_reward_mean, serving_reward_mean, p_value, reason FROM deployments
        ORDER BY time_unix_nano" >"$OUT/deployments.json"
      stop "$SERVICE_PID" ;;
    *) echo "run.sh: unknown stage $stage (hosted, sft, rl)" >&2; exit 2 ;;
  esac
done
"$PY" $HERE/summarize.py --out "$OUT" --records "$LOGS" --data-dir "$DATA" || echo "run.sh: no summary ($OUT)" >&2
