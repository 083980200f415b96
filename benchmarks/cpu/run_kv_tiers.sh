#!/usr/bin/env bash
# The KV tiers and long-context records in docs/kv_tiers.md. Run alone on the machine.
#   multiturn: returning turns' TTFT with host / disk reloads vs recompute, per history
#              length, and the crossover against `servelm plan offload` (default model)
#   long:      TTFT, decode step time, scheduler time and the other streams' stall against
#              context length 1k..128k (tiny random-weight model, llama3 rope scaling)
# Small check: LENGTHS=64,256 LONG_LENGTHS=1024,4096 bash benchmarks/cpu/run_kv_tiers.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
echo "load before: $(cat /proc/loadavg)" >&2
if [[ "${WHICH:-both}" != long ]]; then
  $PY benchmarks/cpu/kv_tiers_multiturn.py --lengths "${LENGTHS:-128,256,512,1024,2048}" \
      --num-convs "${NUM_CONVS:-2}" --out-dir "benchmarks/results/kv-tiers-multiturn-$TS"
fi
if [[ "${WHICH:-both}" != multiturn ]]; then
  $PY benchmarks/cpu/long_context.py \
      --lengths "${LONG_LENGTHS:-1024,2048,4096,8192,16384,32768,65536,131072}" \
      --out-dir "benchmarks/results/long-context-$TS"
fi
echo "load after: $(cat /proc/loadavg)" >&2
