#!/usr/bin/env bash
# The multi-LoRA record in docs/lora.md: 64 concurrent requests on the default model spread
# over 0, 1, 8, 64 and 256 distinct random rank-16 adapters (q_proj, v_proj), with as many
# slots as adapters (up to 32) and with fewer, against LoRA off (and LoRA off with eager
# decode steps, the path a step with adapter rows takes); 2 threads. Run it alone on
# the machine. Small check: CASES=off,1:1,8:4 NUM_REQUESTS=8 OUTPUT_LEN=8 bash ...
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
echo "load before: $(cat /proc/loadavg)" >&2
$PY benchmarks/cpu/lora_bench.py --num-requests "${NUM_REQUESTS:-64}" \
    --input-len "${INPUT_LEN:-64}" --output-len "${OUTPUT_LEN:-64}" --rank 16 \
    --targets "${TARGETS:-q_proj,v_proj}" --cases "${CASES:-off,eager,0:4,1:1,8:8,8:4,64:32,64:8,256:32,256:8}" \
    --threads 2 --adapter-dir "${ADAPTER_DIR:-/tmp/servelm-lora-bench}" \
    --out "benchmarks/results/${PREFIX:-lora}-$TS.json"
echo "load after: $(cat /proc/loadavg)" >&2
