#!/usr/bin/env bash
# The speculative-decoding record in docs/benchmarks.md: every proposer, fixed k and
# adaptive, copy-heavy and open-chat prompts, batch 1/4/16/64, default model, 2 threads.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
echo "load before: $(cat /proc/loadavg)" >&2
$PY -m servelm.cli bench spec smollm2-135m-instruct \
    --methods off,ngram,quant:gguf,layers:8 --modes fixed,adaptive \
    --batch-sizes ${BATCHES:-1,4,16,64} --tasks copy,chat --output-len ${OUTPUT_LEN:-64} \
    --num-speculative-tokens 4 --threads 2 --out benchmarks/results/spec-$TS.json
echo "load after: $(cat /proc/loadavg)" >&2
