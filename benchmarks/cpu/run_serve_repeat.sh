#!/usr/bin/env bash
# How repeatable is one measured serving run? The same seeded workload at the same rate,
# RUNS times in a row against one `servelm serve` (default model, the simulator validation's
# engine and workload: benchmarks/cpu/run_sim_validation.sh), recording each run and every
# step the server ran. The spread of TTFT/TPOT percentiles between identical runs is the
# floor under any prediction's error: at the knee a simulation cannot be nearer to one run
# than the runs are to each other.
#
#   RATE=4.5 RUNS=6 bash benchmarks/cpu/run_serve_repeat.sh       # ~5 min; run it ALONE
#   RESTART=1 ...     # a new server for each run: a drift that restarts undo is the server's
#
# Writes OUT/serve-N.json (bench serve's record), OUT/steps.jsonl (the server's step trace;
# with RESTART=1 one per run, steps-N.jsonl),
# OUT/runs.png (each run's percentiles), OUT/summary.md (per run: goodput, TTFT and TPOT p50/p90/p99, the server's memory after it,
# and, with COST_MODEL=<a cost-model.json>, the run's decode-only steps against that model).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
MODEL=smollm2-135m-instruct
RATE=${RATE:-4.5}
RUNS=${RUNS:-6}
NUM_PROMPTS=${NUM_PROMPTS:-128}
OUT=${OUT:-benchmarks/results/serve-repeat-$(date -u +%Y%m%dT%H%M%SZ)}
RESTART=${RESTART:-0}
mkdir -p "$OUT"
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
SERVER=""
start_server() {  # NAME: the step trace's and the log's
  setsid "$PY" -m servelm.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" --threads 2 \
    --max-num-seqs 64 --no-prefix-cache --no-log-requests --step-trace "$OUT/$1.jsonl" \
    > "$OUT/server-$1.log" 2>&1 &
  SERVER=$!
  until curl -sf -o /dev/null "$URL/v1/models"; do
    kill -0 "$SERVER" 2>/dev/null || { tail -20 "$OUT/server-$1.log" >&2; exit 1; }
    sleep 1
  done
}
stop_server() {
  [ -n "$SERVER" ] || return 0
  kill -TERM -- -"$SERVER" 2>/dev/null || true
  while pgrep -g "$SERVER" > /dev/null; do sleep 0.5; done
  SERVER=""
}
trap stop_server EXIT
[ "$RESTART" = 1 ] || start_server steps
: > "$OUT/rss.txt"
for i in $(seq "$RUNS"); do
  [ "$RESTART" = 1 ] && start_server "steps-$i"
  "$PY" -m servelm.cli bench serve --base-url "$URL" --model "$MODEL" --label servelm \
    --prompt-format ids --input-len 130:500 --output-len 64:128 --slo-ttft-ms 2000 \
    --slo-tpot-ms 200 --goodput-target 0.9 --no-progress --out "$OUT/serve-$i.json" \
    --seed 0 --request-rate "$RATE" --num-prompts "$NUM_PROMPTS" --warmup 2 > /dev/null
  echo "$i $(ps -o rss= -g "$SERVER" | awk '{s += $1} END {print s / 1024}')" >> "$OUT/rss.txt"
  echo "[repeat] run $i of $RUNS done" >&2
  [ "$RESTART" = 1 ] && stop_server
done
stop_server
"$PY" - "$OUT" "${COST_MODEL:-}" <<'EOF' | tee "$OUT/summary.md"
import json, statistics, sys
from datetime import datetime
from pathlib import Path
out, model_path = Path(sys.argv[1]), sys.argv[2]
model = None
if model_path:
    from servelm.engine.step_cost_model import StepCostModel, StepShape
    model = StepCostModel.load(model_path)
steps = [r for f in sorted(out.glob("steps*.jsonl"))
         for r in map(json.loads, f.read_text().splitlines()) if "shape" in r]
rss = dict(line.split() for line in (out / "rss.txt").read_text().splitlines())
rows = sorted(out.glob("serve-*.json"), key=lambda p: int(p.stem.split("-")[1]))
print("| run | goodput | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) "
      "| server RSS after (MiB) | decode-only steps: predicted / measured |")
print("|---|---|---|---|---|---|")
cols = {k: [] for k in ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99")}
for path in rows:
    run = json.loads(path.read_text())
    run = (run.get("runs") or [run])[0]
    i = path.stem.split("-")[1]
    ratio = "-"
    if model is not None:
        t0 = datetime.fromisoformat(run["started_at"]).timestamp()
        dec = [r for r in steps if t0 <= r["t"] <= t0 + run["elapsed_s"] and r["shape"][3] == 0]
        if dec:
            predicted = sum(model.predict(StepShape(*r["shape"])) for r in dec)
            ratio = f"{predicted / sum(r['s'] for r in dec):.3f}"
    for k in cols:
        cols[k].append(run[k[:4] + "_ms"][k[5:]])
    print(f"| {i} | {run['goodput']:.0%} | "
          + " / ".join(f"{run['ttft_ms'][p]:.0f}" for p in ("p50", "p90", "p99")) + " | "
          + " / ".join(f"{run['tpot_ms'][p]:.0f}" for p in ("p50", "p90", "p99"))
          + f" | {float(rss.get(i, 'nan')):.0f} | {ratio} |")
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
for ax, key in zip(axes, ("ttft", "tpot")):
    for p, marker in (("p50", "o"), ("p90", "s"), ("p99", "^")):
        v = cols[f"{key}_{p}"]
        ax.plot(range(1, len(v) + 1), v, marker=marker, label=p)
    ax.set_xlabel("run (same requests, same server)")
    ax.set_ylabel(f"{key.upper()} (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
fig.suptitle(f"{len(rows)} identical runs in a row; {out.name}", fontsize=9)
fig.tight_layout()
fig.savefig(out / "runs.png", dpi=110)
print()
print("Spread over the runs, (max - min) / median: " + ", ".join(
    f"{k.replace('_', ' ')} {(max(v) - min(v)) / statistics.median(v):.0%}"
    for k, v in cols.items()))
EOF
