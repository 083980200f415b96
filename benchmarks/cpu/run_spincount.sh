#!/usr/bin/env bash
# GOMP_SPINCOUNT against throughput (servelm/own_env.py chooses it at start-up): servelm's
# default on 64 prompts x 128 new tokens (2 threads, default model), at spin counts 1000,
# 10000, 50000 and 300000 (libgomp's own default), on quiet cores and beside one busy
# process (a Python busy loop). One JSON per run and summary.md in the result folder.
#   bash benchmarks/cpu/run_spincount.sh          # ~4 min on 2 quiet cores
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT_DIR:-benchmarks/results/spincount-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
echo "results in $OUT; load before: $(cat /proc/loadavg)" >&2
for busy in quiet busy; do
  BP=
  if [ $busy = busy ]; then "$PY" -c "while True: pass" & BP=$!; sleep 1; fi
  for sc in 1000 10000 50000 300000; do
    echo "[$(date -u +%H:%M:%S)] $busy GOMP_SPINCOUNT=$sc" >&2
    GOMP_SPINCOUNT=$sc "$PY" -m servelm.cli bench offline smollm2-135m-instruct \
        --num-prompts 64 --input-len 32:256 --output-len 128 --threads 2 --seed 0 \
        --max-num-seqs 64 --no-progress --out "$OUT/$busy-$sc.json" > /dev/null 2>&1
  done
  [ -z "$BP" ] || kill "$BP"
done
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = ["| GOMP_SPINCOUNT | quiet: output tok/s | beside one busy process |", "|---|---|---|"]
for sc in (1000, 10000, 50000, 300000):
    v = [json.loads((out / f"{b}-{sc}.json").read_text())[0]["output_tok_s"] for b in ("quiet", "busy")]
    rows.append(f"| {sc} | {v[0]:.1f} | {v[1]:.1f} |")
cpu = json.loads((out / "quiet-1000.json").read_text())[0]["machine"]["cpu"]
(out / "summary.md").write_text(f"CPU: {cpu}, 2 threads, 64 x (32:256 + 128)\n\n" + "\n".join(rows) + "\n")
print((out / "summary.md").read_text())
PY
