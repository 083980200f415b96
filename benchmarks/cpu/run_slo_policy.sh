#!/usr/bin/env bash
# What the SLO scheduling policy buys over FCFS, per SLO class, simulated and measured:
# the same mix of interactive (short prompts, tight TTFT/TPOT) and batch (long prompts,
# loose targets) requests, (1) simulated with `servelm sim --scheduling-policy fcfs|slo` on
# the step-cost model calibrated on this machine, (2) measured against `servelm serve
# --scheduling-policy fcfs|slo` of the default model. Writes
# benchmarks/results/slo-policy-<UTC>/ (spec, sims, measured runs, summary.md).
#
# Run it ALONE on the machine (timed): about 4 minutes (2 servers x ~90 s of load).
#   bash benchmarks/cpu/run_slo_policy.sh
#   DRY=1 bash benchmarks/cpu/run_slo_policy.sh     # tiny end-to-end check, /tmp only
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
MODEL=smollm2-135m-instruct
TS=$(date -u +%Y%m%dT%H%M%SZ)
# The engine the validation record calibrated (2 threads, 64 seqs); its cost model is what
# the simulation and the server's slo policy predict with.
COST=${COST:-benchmarks/results/sim-validation-20261201T134728Z/cost-model.json}
RATE=${RATE:-1.5}                 # about the knee of that record (1 req/s of 130-500 tokens)
NUM_PROMPTS=${NUM_PROMPTS:-120}
OUT=${OUT:-benchmarks/results/slo-policy-$TS}
if [ "${DRY:-0}" = 1 ]; then NUM_PROMPTS=6; OUT=/tmp/servelm-slo-policy-dry-$TS; fi
mkdir -p "$OUT"
cat > "$OUT/slo.json" <<'JSON'
{"classes": [
  {"name": "interactive", "priority": 0, "ttft_ms": 1500, "tpot_ms": 150, "percentile": 90},
  {"name": "batch", "priority": 1, "ttft_ms": 30000, "tpot_ms": 400, "percentile": 50,
   "reject_early": false}],
 "default_class": "interactive", "window_s": 60}
JSON
MIX=(--slo-spec "$OUT/slo.json" --class-mix interactive=0.7,batch=0.3
     --class-len interactive=32:128/16:48 --class-len batch=600:1200/64:128
     --num-prompts "$NUM_PROMPTS" --seed 0)

# 1. Simulated, both policies.
for pol in fcfs slo; do
  "$PY" -m servelm.cli sim --cost-model "$COST" --request-rate "$RATE" "${MIX[@]}" \
    --scheduling-policy "$pol" --out "$OUT/sim-$pol.json" > "$OUT/sim-$pol.txt"
done

# 2. Measured, both policies, one server each.
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
for pol in fcfs slo; do
  # only the slo policy reads a step-cost model (serve refuses one for fcfs)
  cost_args=(); [[ $pol == slo ]] && cost_args=(--slo-cost-model "$COST")
  setsid "$PY" -m servelm.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" --threads 2 \
    --max-num-seqs 64 --no-prefix-cache --no-log-requests --slo-spec "$OUT/slo.json" \
    --scheduling-policy "$pol" "${cost_args[@]}" > "$OUT/server-$pol.log" 2>&1 &
  SERVER_PID=$!
  until curl -sf -o /dev/null "$URL/v1/models"; do
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$OUT/server-$pol.log" >&2; exit 1; }
    sleep 1
  done
  "$PY" -m servelm.cli bench serve --base-url "$URL" --model "$MODEL" --label "servelm-$pol" \
    --prompt-format ids --request-rate "$RATE" "${MIX[@]}" --warmup 2 --no-progress \
    --out "$OUT/measured-$pol.json" > "$OUT/measured-$pol.txt"
  stop_server
done

# 3. The table: goodput per class, simulated and measured, each policy.
"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
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
