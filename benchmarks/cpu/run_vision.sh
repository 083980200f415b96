#!/usr/bin/env bash
# The vision record in docs/vision.md: text streams' TPOT/TTFT while a burst of image
# requests arrives, with the encoder budget off and on, and encoder time per image against
# its token count, on a small random-weight Qwen2-VL (built by transformers, no download);
# 2 threads. Run it alone on the machine (about 3 minutes).
# Small check: SIZE=tiny ARGS="--burst 2 --output-len 8 --encoder-sizes 112,224" bash ...
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
echo "load before: $(cat /proc/loadavg)" >&2
# shellcheck disable=SC2086
$PY benchmarks/cpu/vision_bench.py --size "${SIZE:-small}" --threads 2 ${ARGS:-} \
    --out "benchmarks/results/${PREFIX:-vision}-$TS"
echo "load after: $(cat /proc/loadavg)" >&2
