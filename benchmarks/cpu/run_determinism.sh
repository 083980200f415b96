#!/usr/bin/env bash
# What --deterministic costs (docs/determinism.md): servelm with and without it on the default
# model, 2 threads: one stream (128-token prompt, 128 new tokens) and 64 prompts of 32-256
# tokens x 128 new tokens. Both run --dtype auto: today's default (bfloat16 where the CPU runs
# bfloat16 dot products, else float32) against deterministic mode in the same dtype; the
# summary records each mode's dtype (model_dtype) and fails if they differ. The two
# configurations alternate (REPS rounds of default then deterministic) so a change in the
# machine's load hits both; a summary JSON holds the per-round throughputs, their medians and
# the ratio.
#   bash benchmarks/cpu/run_determinism.sh                        # the record
#   REPS=1 NUM_PROMPTS=4 OUTPUT_LEN=8 SINGLE_LEN=16 bash benchmarks/cpu/run_determinism.sh  # a check
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-benchmarks/results}
REPS=${REPS:-2}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-32:256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
SINGLE_LEN=${SINGLE_LEN:-128}
COMMON=(--threads 2 --seed 0 --max-num-seqs 64 --no-progress)
echo "load before: $(cat /proc/loadavg)" >&2
for rep in $(seq 1 "$REPS"); do
  for mode in default deterministic; do
    FLAG=(); [ "$mode" = deterministic ] && FLAG=(--deterministic)
    $PY -m servelm.cli bench offline smollm2-135m-instruct --num-prompts 1 \
        --input-len "$SINGLE_LEN" --output-len "$SINGLE_LEN" "${FLAG[@]}" "${COMMON[@]}" \
        --out "$OUT/determinism-single-$mode-$rep-$TS.json"
    $PY -m servelm.cli bench offline smollm2-135m-instruct --num-prompts "$NUM_PROMPTS" \
        --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" "${FLAG[@]}" "${COMMON[@]}" \
        --out "$OUT/determinism-batch-$mode-$rep-$TS.json"
  done
done
echo "load after: $(cat /proc/loadavg)" >&2
$PY - "$OUT" "$TS" "$REPS" <<'PY'
import glob, json, statistics, sys
out, ts, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
summary = {"timestamp": ts, "rounds": reps, "workloads": {}}
for workload in ("single", "batch"):
    row = {}
    for mode in ("default", "deterministic"):
        runs = []
        for rep in range(1, reps + 1):
            doc = json.load(open(f"{out}/determinism-{workload}-{mode}-{rep}-{ts}.json"))
            runs.append(next(r for r in doc if r["system"] == "servelm")
                        if isinstance(doc, list) else doc)
        row[mode] = {"output_tok_s": [r["output_tok_s"] for r in runs],
                     "median_output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
                     "decode_tok_s": [r["decode_tok_s"] for r in runs],
                     "ttft_mean_s": [r["ttft_s"]["mean"] for r in runs],
                     "command": runs[0].get("command"), "commit": runs[0].get("commit"),
                     "machine": runs[0].get("machine"),
                     "model_dtype": sorted({r["settings"]["model_dtype"] for r in runs})}
    if row["default"]["model_dtype"] != row["deterministic"]["model_dtype"]:
        sys.exit(f"{workload}: the modes ran different dtypes: default "
                 f"{row['default']['model_dtype']}, deterministic "
                 f"{row['deterministic']['model_dtype']}")
    d, n = row["deterministic"]["median_output_tok_s"], row["default"]["median_output_tok_s"]
    row["deterministic_over_default"] = d / n
    row["cost_percent"] = 100 * (1 - d / n)
    summary["workloads"][workload] = row
path = f"{out}/determinism-{ts}.json"
json.dump(summary, open(path, "w"), indent=1)
for w, row in summary["workloads"].items():
    print(f"{w} ({'/'.join(row['default']['model_dtype'])}): default "
          f"{row['default']['median_output_tok_s']:.1f} tok/s, deterministic "
          f"{row['deterministic']['median_output_tok_s']:.1f} tok/s, cost "
          f"{row['cost_percent']:.1f}%")
print(path)
PY
