#!/usr/bin/env bash
# servelm on one H200, in under 8 minutes: batch-1 decode (Llama-3.1-8B shape), offline
# throughput (Qwen3-0.6B and Llama-3.1-8B shapes) for servelm and for HF transformers'
# continuous batching, all with dummy weights in bf16. Each phase runs in its own process
# under its own time limit, so one slow phase cannot eat the others' time.
#
#   bash benchmarks/gpu/run_h200.sh                 # from the repository root
#   bash benchmarks/gpu/run_h200.sh --with-tests    # first the kernel/attention tests (~1-2 min)
#
# CPU dry run of the plumbing (numbers meaningless; Triton interpreted):
#   TRITON_INTERPRET=1 PYTHON=.venv/bin/python LIMIT_SCALE=4 \
#     EXTRA_ARGS="--device cpu --tiny --dtype float32 --max-num-seqs 4" bash benchmarks/gpu/run_h200.sh
#
# Results: benchmarks/results/h200-<UTC time>/*.json and table.txt (and copies in $OUT when
# that is set, as on a lent device machine). Needs python3 with torch (CUDA), triton and
# transformers; servelm is used from this checkout (PYTHONPATH), not installed.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
DIR=benchmarks/results/h200-$STAMP
mkdir -p "$DIR"
BENCH="$PY benchmarks/gpu/h200_bench.py"
LOG="$DIR/log.txt"

if [ "${1:-}" = "--with-tests" ]; then
  timeout 150 $PY -m pytest -q -x tests/kernels tests/attention 2>&1 | tee -a "$LOG"
fi

phase() {  # phase LIMIT_S NAME ARGS...
  local limit=$(( $1 * ${LIMIT_SCALE:-1} )) name=$2; shift 2
  echo "== $name (limit ${limit}s)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" $BENCH "$@" ${EXTRA_ARGS:-} --out "$DIR/$name.json" 2>&1 \
    | tee -a "$LOG" | grep -v "^\[transformers\]" | tail -n 5
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0))s" | tee -a "$LOG"
}

$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" \
  | tee -a "$LOG"
phase 75  decode-llama-3.1-8b  decode  --decode-model dummy:llama-3.1-8b
phase 90  offline-qwen3-0.6b   offline --model dummy:qwen3-0.6b
phase 120 offline-llama-3.1-8b offline --model dummy:llama-3.1-8b
phase 70  hf-qwen3-0.6b        hf      --model dummy:qwen3-0.6b   --hf-time-limit 50
phase 90  hf-llama-3.1-8b      hf      --model dummy:llama-3.1-8b --hf-time-limit 65

$BENCH report --inputs "$DIR"/*.json | tee "$DIR/table.txt"
if [ -n "${OUT:-}" ]; then cp "$DIR"/*.json "$DIR/table.txt" "$LOG" "$OUT"/ 2>/dev/null; fi
echo "results in $DIR"
