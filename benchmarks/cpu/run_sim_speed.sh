#!/usr/bin/env bash
# The simulator's speed on the 10,000 req/s 70B question (docs/sim.md): simulated requests
# per wall second for slices of that fleet (the same load per replica: 12.5 req/s on each of
# N replicas of Llama-3.1-70B on 8 x H100-SXM, 2,000-token prompts, 300-token answers), and
# what the whole question (10 minutes of 10,000 req/s = 6,000,000 requests) would take at
# that speed; the bar is 30 minutes (3,333 req / wall s). Also one cProfile run of the
# smallest slice, its top functions and the profiler's overhead (wall with / without).
# Writes benchmarks/results/sim-speed-<UTC>/ (summary.json, summary.md, profile.txt).
#
# The fleet runs in one process per usable core (`servelm sim --shards auto`).
# Run it ALONE on the machine (timed): about 10 minutes on a slow 2-core machine.
#   bash benchmarks/cpu/run_sim_speed.sh
#   DRY=1 bash benchmarks/cpu/run_sim_speed.sh      # tiny, /tmp only
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-benchmarks/results/sim-speed-$TS}
# replicas:req/s:requests; the first three are short (their start and drain are a large part),
# the last two run long enough for the steady state: 40 s of 80 replicas' traffic, and 30 s
# of the whole fleet's (800 replicas at 10,000 req/s)
SLICES=${SLICES:-"8:100:1500 32:400:3000 80:1000:4000 80:1000:40000 800:10000:300000"}
if [ "${DRY:-0}" = 1 ]; then SLICES="2:25:60"; OUT=/tmp/servelm-sim-speed-dry-$TS; fi
mkdir -p "$OUT"
FLEET=(--gpu H100-SXM --model Llama-3.1-70B --tp 8 --policy least_loaded --input-len 2000
       --output-len 300 --max-num-seqs 555 --max-num-batched-tokens 1369
       --slo-ttft-ms 1000 --slo-tpot-ms 50)
for s in $SLICES; do
  IFS=: read -r n rate num <<< "$s"
  "$PY" -m servelm.cli sim "${FLEET[@]}" --num-replicas "$n" --request-rate "$rate" \
    --num-prompts "$num" --out "$OUT/slice-$n-$num.json" > /dev/null 2> "$OUT/slice-$n-$num.log"
done
# the same-run gain of the shards: the first slice and SERIAL (replicas:req/s:requests) in
# one process
SERIAL=${SERIAL:-80:1000:40000}
if [ "${DRY:-0}" = 1 ]; then SERIAL=2:25:60; fi
first=${SLICES%% *}
for s in "$first" "$SERIAL"; do
  IFS=: read -r n rate num <<< "$s"
  "$PY" -m servelm.cli sim "${FLEET[@]}" --num-replicas "$n" --request-rate "$rate" \
    --num-prompts "$num" --shards 1 --out "$OUT/serial-$n-$num.json" > /dev/null \
    2> "$OUT/serial-$n-$num.log"
done
IFS=: read -r n rate num <<< "$first"
"$PY" -m cProfile -o "$OUT/profile.out" -m servelm.cli sim "${FLEET[@]}" --num-replicas "$n" \
  --request-rate "$rate" --num-prompts "$num" --shards 1 --out "$OUT/profiled-$n.json" > /dev/null 2>&1
"$PY" - "$OUT" "$first" <<'PYEOF' | tee "$OUT/summary.md"
import json, pstats, sys
from pathlib import Path
out, first = Path(sys.argv[1]), sys.argv[2].split(":")[0]
rows = []
for f in sorted(out.glob("slice-*.json"), key=lambda p: tuple(map(int, p.stem.split("-")[1:]))):
    r = json.loads(f.read_text())
    s = r["sim"]
    rows.append({"num_replicas": s["num_replicas"], "request_rate": r["load"]["request_rate"],
                 "num_requests": r["num_requests"], "num_shards": s.get("num_shards", 1),
                 "wall_s": s["wall_s"],
                 "req_per_wall_s": s["simulated_requests_per_wall_s"],
                 "bulk_share": s["num_bulk_steps"] / max(1, s["num_steps"]),
                 "hidden_share": s.get("num_mixed_steps", 0) / max(1, s["num_steps"]),
                 "ttft_p50_ms": r["ttft_ms"]["p50"], "goodput": r["goodput"],
                 "max_rss_mb": s["max_rss_mb"],
                 "whole_question_h": 6_000_000 / s["simulated_requests_per_wall_s"] / 3600})
prof = json.loads((out / f"profiled-{first}.json").read_text())["sim"]["wall_s"]
serial = {}
for f in out.glob("serial-*.json"):
    r = json.loads(f.read_text())
    serial[(r["sim"]["num_replicas"], r["num_requests"])] = r
plain = serial[(rows[0]["num_replicas"], rows[0]["num_requests"])]["sim"]["wall_s"]
gains = []
for x in rows:
    one = serial.get((x["num_replicas"], x["num_requests"]))
    if one is not None:
        same = (one["ttft_ms"] == json.loads((out / f"slice-{x['num_replicas']}-"
                                              f"{x['num_requests']}.json").read_text())["ttft_ms"])
        gains.append({"num_replicas": x["num_replicas"], "num_requests": x["num_requests"],
                      "one_process_req_per_wall_s": one["sim"]["simulated_requests_per_wall_s"],
                      "sharded_req_per_wall_s": x["req_per_wall_s"], "num_shards": x["num_shards"],
                      "gain": x["req_per_wall_s"] / one["sim"]["simulated_requests_per_wall_s"],
                      "same_ttft_block": same})
(out / "summary.json").write_text(json.dumps({"slices": rows, "one_process": gains,
                                              "profiler_overhead": prof / plain,
                                              "bar_req_per_wall_s": 3333}, indent=2) + "\n")
print("| replicas | req/s | requests | processes | wall s | simulated req / wall s | bulk steps | steps with hidden decodes | TTFT p50 ms | goodput | peak memory | 6M requests would take |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for x in rows:
    print(f"| {x['num_replicas']} | {x['request_rate']:g} | {x['num_requests']} | "
          f"{x['num_shards']} | {x['wall_s']:.1f} | "
          f"{x['req_per_wall_s']:.0f} | {x['bulk_share']:.0%} | {x['hidden_share']:.0%} | "
          f"{x['ttft_p50_ms']:.0f} | "
          f"{x['goodput']:.0%} | {x['max_rss_mb'] / 1024:.2f} GiB | "
          f"{x['whole_question_h']:.1f} h |")
for g in gains:
    print(f"\none process, {g['num_replicas']} replicas, {g['num_requests']} requests: "
          f"{g['one_process_req_per_wall_s']:.0f} req / wall s; {g['num_shards']} processes "
          f"{g['gain']:.2f}x that; the same TTFT block: {g['same_ttft_block']}")
print(f"\nbar: 3,333 simulated req / wall s (6M requests in 30 min); cProfile overhead on the "
      f"{first}-replica slice: {prof / plain:.2f}x wall")
with open(out / "profile.txt", "w") as f:
    pstats.Stats(str(out / "profile.out"), stream=f).sort_stats("tottime").print_stats(30)
PYEOF
rm -f "$OUT/profile.out"
echo "[sim-speed] wrote $OUT; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
