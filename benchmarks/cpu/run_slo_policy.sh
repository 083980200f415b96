#!/usr/bin/env bash
# What the SLO scheduling policy buys over FCFS, per SLO class, simulated and measured:
# the same mix of interactive (short prompts, tight TTFT/TPOT) and batch (long prompts,
# loose targets) requests, (1) simulated with `servelm sim --scheduling-policy fcfs|slo` on
# a step-cost model of this machine's served engine, (2) measured against `servelm serve
# --scheduling-policy fcfs|slo` of the default model, whose slo policy predicts with the same
# model. Writes benchmarks/results/slo-policy-<UTC>/ (spec, cost model, sims, measured runs,
# summary.md).
#
# The cost model (stage 0, unless COST=FILE is given): calibrated from SERVED steps, as the
# simulator's validation record does (docs/sim.md): an fcfs server of the same engine with
# --step-trace serves the same class mix at CAL_RATES with another seed, and `servelm bench
# calibrate --served-steps` fits the model to the steps it ran (start to next start: what
# serving spends per step, which a lone-engine calibration leaves out and so predicted too
# optimistically for the policy's early rejections and chunk sizes).
#
# Run it ALONE on the machine (timed): about 6 minutes (3 servers x ~90 s of load).
#   bash benchmarks/cpu/run_slo_policy.sh
#   COST=benchmarks/results/sim-validation-<UTC>/cost-model.json bash benchmarks/cpu/run_slo_policy.sh
#   DRY=1 bash benchmarks/cpu/run_slo_policy.sh     # tiny end-to-end check, /tmp only
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
MODEL=smollm2-135m-instruct
TS=$(date -u +%Y%m%dT%H%M%SZ)
ENGINE=(--threads 2 --max-num-seqs 64 --no-prefix-cache)  # the same engine in every stage
COST=${COST:-}                    # a step-cost model file; empty: calibrate it (stage 0)
RATE=${RATE:-1.5}                 # about the knee of the validation record (1 req/s of 130-500 tokens)
NUM_PROMPTS=${NUM_PROMPTS:-120}
CAL_RATES=${CAL_RATES:-0.75 2.5}  # calibration: other rates than the measured one
CAL_PROMPTS=${CAL_PROMPTS:-40}
OUT=${OUT:-benchmarks/results/slo-policy-$TS}
if [ "${DRY:-0}" = 1 ]; then
  NUM_PROMPTS=6; CAL_PROMPTS=4; CAL_RATES="2 4"; OUT=/tmp/servelm-slo-policy-dry-$TS
fi
mkdir -p "$OUT"
cat > "$OUT/slo.json" <<'JSON'
{"classes": [
  {"name": "interactive", "priority": 0, "ttft_ms": 1500, "tpot_ms": 150, "percentile": 90},
  {"name": "batch", "priority": 1, "ttft_ms": 30000, "tpot_ms": 400, "percentile": 50,
   "reject_early": false}],
 "default_class": "interactive", "window_s": 60}
JSON
CLASSES=(--slo-spec "$OUT/slo.json" --class-mix interactive=0.7,batch=0.3
         --class-len interactive=32:128/16:48 --class-len batch=600:1200/64:128)
MIX=("${CLASSES[@]}" --num-prompts "$NUM_PROMPTS" --seed 0)

PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
  for _ in $(seq 60); do pgrep -g "$SERVER_PID" >/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT
start_server() {  # LOGNAME SERVE-FLAGS...
  local log=$1
  shift
  setsid "$PY" -m servelm.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" "${ENGINE[@]}" \
    --no-log-requests --slo-spec "$OUT/slo.json" "$@" > "$OUT/$log.log" 2>&1 &
  SERVER_PID=$!
  until curl -sf -o /dev/null "$URL/v1/models"; do
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$OUT/$log.log" >&2; exit 1; }
    sleep 1
  done
}

# 0. The step-cost model of the served engine (unless COST is given).
if [ -z "$COST" ]; then
  start_server server-calibrate --scheduling-policy fcfs --step-trace "$OUT/calibrate-steps.jsonl"
  for rate in $CAL_RATES; do
    "$PY" -m servelm.cli bench serve --base-url "$URL" --model "$MODEL" --label calibrate \
      --prompt-format ids --request-rate "$rate" "${CLASSES[@]}" --num-prompts "$CAL_PROMPTS" \
      --seed 1 --warmup 2 --no-progress --out "$OUT/calibrate-$rate.json" > /dev/null
  done
  stop_server  # the trace is complete once the server has stopped
  "$PY" -m servelm.cli bench calibrate "$MODEL" --served-steps "$OUT/calibrate-steps.jsonl" \
    --name "$MODEL-served" --out "$OUT/cost-model.json" > "$OUT/calibrate.txt"
  COST=$OUT/cost-model.json
fi

# 1. Simulated, both policies.
for pol in fcfs slo; do
  "$PY" -m servelm.cli sim --cost-model "$COST" --request-rate "$RATE" "${MIX[@]}" \
    --scheduling-policy "$pol" --out "$OUT/sim-$pol.json" > "$OUT/sim-$pol.txt"
done

# 2. Measured, both policies, one server each.
for pol in fcfs slo; do
  # only the slo policy reads a step-cost model (serve refuses one for fcfs)
  cost_args=(); [[ $pol == slo ]] && cost_args=(--slo-cost-model "$COST")
  start_server "server-$pol" --scheduling-policy "$pol" "${cost_args[@]}"
  "$PY" -m servelm.cli bench serve --base-url "$URL" --model "$MODEL" --label "servelm-$pol" \
    --prompt-format ids --request-rate "$RATE" "${MIX[@]}" --warmup 2 --no-progress \
    --out "$OUT/measured-$pol.json" > "$OUT/measured-$pol.txt"
  stop_server
done

# 3. The table: goodput per class, simulated and measured, each policy.
"$PY" - "$OUT" "$COST" <<'PYEOF' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
fit = json.loads(Path(sys.argv[2]).read_text())["fit"]
print(f"Cost model: {sys.argv[2]} ({fit.get('source', 'engine')} steps, mean |error| "
      f"{fit['mean_abs_rel_error']:.1%} over {fit['num_samples']})\n")
print("| policy | class | simulated goodput (met / n, rejected) | measured goodput (met / n, rejected) |")
print("|---|---|---|---|")
for pol in ("fcfs", "slo"):
    sim = json.loads((out / f"sim-{pol}.json").read_text())["slo"]["by_class"]
    meas = json.loads((out / f"measured-{pol}.json").read_text())["slo"]["by_class"]
    for name in sim:
        s, m = sim[name], meas[name]
        cell = lambda r: (f"{(r['goodput'] or 0):.0%} ({r['num_met']} / {r['num_requests']}, "
                          f"{r['num_rejected']})")
        print(f"| {pol} | {name} | {cell(s)} | {cell(m)} |")
PYEOF
echo "[slo-policy] wrote $OUT; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
