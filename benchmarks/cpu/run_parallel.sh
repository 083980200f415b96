#!/usr/bin/env bash
# Tensor parallelism on the CPU (docs/parallel.md): gloo all-reduce microseconds per call at
# decode sizes, the bytes all-reduced per token per layer against the planner's formula, and
# decode tok/s of the default model (float32) at 2 cores in all: TP=1 (2 threads) against
# TP=2 (1 thread per rank), each on the C++ decode stack and on the eager path, one stream
# and 64. About 4-5 minutes on an idle 2-core machine; run it alone (another process on the
# cores changes the figures several-fold).
#   bash benchmarks/cpu/run_parallel.sh            -> benchmarks/results/parallel-<UTC>/
#   QUICK=1 bash benchmarks/cpu/run_parallel.sh    tiny sizes: checks that it runs
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$PWD/.venv/bin/python}
echo "load before: $(cat /proc/loadavg)" >&2
"$PY" benchmarks/cpu/parallel_bench.py ${QUICK:+--quick} "$@"
