#!/usr/bin/env bash
# Decode speed per quantization method (docs/quantization.md): one stream (128-token
# prompt, 128 new tokens) and 64 prompts x 128 new tokens, default model, 2 threads; plus the
# single-stream target, servelm --quantization gguf vs llama.cpp on the same GGUF in one run.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=${PEERS:-/work/peers}
PY=${PY:-.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
OUT=benchmarks/results
COMMON=(--threads 2 --seed 0 --max-num-seqs 64 --no-progress)
echo "load before: $(cat /proc/loadavg)" >&2
$PY -m servelm.cli bench offline smollm2-135m-instruct --num-prompts 1 --input-len 128 \
    --output-len 128 --quantization gguf --peers llama.cpp \
    --peer-python "llama.cpp=$PEERS/llama/bin/python" "${COMMON[@]}" \
    --out "$OUT/quant-single-gguf-vs-llama.cpp-$TS.json"
for m in none int8 int4-g32 int4-g128 gguf fp8-kv; do
  case $m in
    none) Q=() ;;
    fp8-kv) Q=(--kv-cache-dtype fp8) ;;
    *) Q=(--quantization "$m") ;;
  esac
  $PY -m servelm.cli bench offline smollm2-135m-instruct --num-prompts 1 --input-len 128 \
      --output-len 128 "${Q[@]}" "${COMMON[@]}" --out "$OUT/quant-single-$m-$TS.json"
  $PY -m servelm.cli bench offline smollm2-135m-instruct --num-prompts 64 --input-len 32:256 \
      --output-len 128 "${Q[@]}" "${COMMON[@]}" --out "$OUT/quant-batch64-$m-$TS.json"
done
echo "load after: $(cat /proc/loadavg)" >&2
