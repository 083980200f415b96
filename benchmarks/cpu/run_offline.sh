#!/usr/bin/env bash
# The CPU offline record in docs/benchmarks.md: servelm and its peers side by side, one system
# at a time, on the default model. Peer environments live outside the repo (see
# servelm/bench/setup_peers.sh): PEERS=/path/to/peers.
#   bash benchmarks/cpu/run_offline.sh            # all three records
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=${PEERS:-/work/peers}
PY=${PY:-.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
OUT=benchmarks/results
PEER_ARGS=(--peers llama.cpp,vllm,hf
           --peer-python "llama.cpp=$PEERS/llama/bin/python,vllm=$PEERS/vllm/bin/python"
           --peer-model "vllm=$PEERS/smollm2-hf,hf=$PEERS/smollm2-hf"
           --threads 2 --seed 0 --max-num-seqs 64)
echo "load before: $(cat /proc/loadavg)" >&2
# (1) one stream, 128-token prompt, 128 new tokens: decode tok/s and TTFT
$PY -m servelm.cli bench offline smollm2-135m-instruct --num-prompts 1 --input-len 128 \
    --output-len 128 "${PEER_ARGS[@]}" --out "$OUT/offline-single-$TS.json"
# (2) 64 prompts of 32-256 tokens, 128 new tokens each: output tok/s
$PY -m servelm.cli bench offline smollm2-135m-instruct --num-prompts 64 --input-len 32:256 \
    --output-len 128 "${PEER_ARGS[@]}" --out "$OUT/offline-batch64-$TS.json"
# (3) prefix cache on vs off: 32 requests = 2000 shared + 100 unique tokens, 128 new tokens
[ "${SKIP_PREFIX:-0}" = 1 ] || $PY -m servelm.cli bench offline smollm2-135m-instruct --workload shared-prefix \
    --num-prompts 32 --prefix-len 2000 --suffix-len 100 --output-len 128 \
    --compare-prefix-cache --threads 2 --seed 0 --max-num-seqs 64 \
    --out "$OUT/offline-shared-prefix-$TS.json"
echo "load after: $(cat /proc/loadavg)" >&2
