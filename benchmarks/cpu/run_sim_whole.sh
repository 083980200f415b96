#!/usr/bin/env bash
# The simulator's speed bar run whole, not extrapolated from slices (run_sim_speed.sh): 10
# minutes of a 10,000 req/s fleet of Llama-3.1-70B on 800 replicas of 8 x H100-SXM
# (6,000,000 requests, 2,000-token prompts, 300-token answers), the replicas in one process
# per usable core. The bar is 30 minutes of wall time. The run prints a progress line every
# 10 s; /usr/bin/time -v gives its wall time and peak memory (the parent's and, summed by
# the simulator, the shards').
# Writes benchmarks/results/sim-whole-<UTC>/ (whole.json and .png, whole.log, time.txt,
# summary.md). Run it ALONE on the machine: 20-50 minutes on a 2-core machine, ~15 GB.
#   bash benchmarks/cpu/run_sim_whole.sh
#   DRY=1 bash benchmarks/cpu/run_sim_whole.sh      # 60,000 requests, /tmp only
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-benchmarks/results/sim-whole-$TS}
NUM=${NUM:-6000000}
if [ "${DRY:-0}" = 1 ]; then NUM=60000; OUT=/tmp/servelm-sim-whole-dry-$TS; fi
mkdir -p "$OUT"
/usr/bin/time -v -o "$OUT/time.txt" "$PY" -m servelm.cli sim --gpu H100-SXM \
  --model Llama-3.1-70B --tp 8 --policy least_loaded --input-len 2000 --output-len 300 \
  --max-num-seqs 555 --max-num-batched-tokens 1369 --slo-ttft-ms 1000 --slo-tpot-ms 50 \
  --num-replicas 800 --request-rate 10000 --num-prompts "$NUM" --shards auto \
  --out "$OUT/whole.json" 2>&1 | tee "$OUT/whole.log" >&2
"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.md"
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
r = json.loads((out / "whole.json").read_text())
s = r["sim"]
t = (out / "time.txt").read_text()
elapsed = re.search(r"Elapsed \(wall clock\) time.*: (.*)", t).group(1)
print(f"{r['num_requests']:,} requests on {s['num_replicas']} replicas in {s['num_shards']} "
      f"processes: {s['wall_s'] / 60:.1f} min of simulation ({elapsed} for the whole command), "
      f"{s['simulated_requests_per_wall_s']:,.0f} simulated requests per wall second; "
      f"{r['elapsed_s']:.0f} simulated s; bar 30 min: "
      f"{'met' if s['wall_s'] <= 1800 else 'not met'}")
print(f"TTFT p50 / p99 {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} ms, TPOT p50 / p99 "
      f"{r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f} ms, goodput {r['goodput']:.1%}; "
      f"peak memory {s['max_rss_mb'] / 1024:.2f} GiB (the parent's and the shards' peaks "
      f"summed); "
      f"machine {r['machine']['cpu']}, commit {r['commit'][:7]}")
PYEOF
echo "[sim-whole] wrote $OUT" >&2
