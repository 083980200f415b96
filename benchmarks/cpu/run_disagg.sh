#!/usr/bin/env bash
# The disaggregation record in docs/disaggregation.md: decode streams' TPOT and the long
# prompts' TTFT with `servelm serve --disagg 1:1 --threads 1` against one colocated
# `servelm serve --threads 2` (same total cores, greedy outputs compared), then tcp and shm
# KV throughput on loopback against memory copy bandwidth. Default model; run it alone on
# the machine (about 5 minutes).
# Small check: SCALE=tiny ARGS="--frames 50" bash benchmarks/cpu/run_disagg.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
echo "load before: $(cat /proc/loadavg)" >&2
# shellcheck disable=SC2086
$PY benchmarks/cpu/disagg_bench.py --scale "${SCALE:-full}" ${ARGS:-} \
    --out "benchmarks/results/${PREFIX:-disagg}-$TS"
echo "load after: $(cat /proc/loadavg)" >&2
