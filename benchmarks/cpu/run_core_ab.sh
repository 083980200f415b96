#!/usr/bin/env bash
# The engine-core boundary check in docs/benchmarks.md: the same measurements on two commits,
# interleaved A B A B so that the machine's drift cancels, medians compared.
#   A (before): BEFORE=<commit>, checked out into a temporary tree and run from there (the
#               current directory comes first on sys.path, before the editable install)
#   B (after):  this working tree, or AFTER=<commit> checked out the same way (a tree others
#               edit while the run goes on must not be measured: set AFTER then)
# Measurements per system and round, default model, 2 threads:
#   offline single stream (1 prompt x 128 tokens, 128 new): decode tok/s
#   offline batch (64 prompts of 32-256 tokens, 128 new): output tok/s
#   served single stream (`servelm serve` + `servelm bench serve --concurrency 1`, 8 requests):
#     1 / TPOT, through the HTTP front end and (B) the engine core process
#   served batch (--concurrency 32, 64 requests): output tok/s
#   BEFORE=3ee921c bash benchmarks/cpu/run_core_ab.sh
#   WHAT='A is ...|B is ...' names the two systems in the summary
#   PARTS=serve ROUNDS=3 OUT_DIR=<an earlier run's folder> ...  adds rounds of one part
set -euo pipefail
cd "$(dirname "$0")/../.."
BEFORE=${BEFORE:?set BEFORE to the commit to compare against}
ROUNDS=${ROUNDS:-2}
PY=${PY:-$PWD/.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT_DIR:-$PWD/benchmarks/results/core-ab-$TS}
PARTS=${PARTS:-offline,serve}
FIRST_ROUND=${FIRST_ROUND:-1}
mkdir -p "$OUT"
TREE=$(mktemp -d /tmp/servelm-before-XXXX)
git archive "$BEFORE" | tar -x -C "$TREE"
AFTER_TREE=
if [ -n "${AFTER:-}" ]; then
  AFTER_TREE=$(mktemp -d /tmp/servelm-after-XXXX)
  git archive "$AFTER" | tar -x -C "$AFTER_TREE"
fi
trap 'rm -rf "$TREE" ${AFTER_TREE:+"$AFTER_TREE"}' EXIT
MODEL=smollm2-135m-instruct
echo "load before: $(cat /proc/loadavg)" >&2

run_system() {  # $1 = A|B, $2 = round
  local sys=$1 r=$2 pp=() here=$PWD
  if [ "$sys" = A ]; then cd "$TREE"; elif [ -n "$AFTER_TREE" ]; then cd "$AFTER_TREE"; fi
  "$PY" -c 'import servelm, sys; print("servelm from", servelm.__file__, file=sys.stderr)'
  if [[ $PARTS == *offline* ]]; then
  "$PY" -m servelm.cli bench offline $MODEL --num-prompts 1 --input-len 128 \
      --output-len 128 --threads 2 --seed 0 --max-num-seqs 64 --no-progress \
      --out "$OUT/offline-single-$sys-$r.json" >/dev/null
  "$PY" -m servelm.cli bench offline $MODEL --num-prompts 64 --input-len 32:256 \
      --output-len 128 --threads 2 --seed 0 --max-num-seqs 64 --no-progress \
      --out "$OUT/offline-batch64-$sys-$r.json" >/dev/null
  fi
  [[ $PARTS == *serve* ]] || { cd "$here"; return; }
  local port=$((18000 + RANDOM % 1000))
  "$PY" -m servelm.cli serve $MODEL --port $port --threads 2 --max-num-seqs 64 \
      --no-log-requests 2>"$OUT/serve-$sys-$r.log" &
  local pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2
  done
  "$PY" -m servelm.cli bench serve --base-url "http://127.0.0.1:$port" --model $MODEL \
      --label "$sys" --concurrency 1 --num-prompts 8 --input-len 128 --output-len 128 \
      --seed 0 --warmup 1 --no-progress --out "$OUT/serve-single-$sys-$r.json" >/dev/null
  "$PY" -m servelm.cli bench serve --base-url "http://127.0.0.1:$port" --model $MODEL \
      --label "$sys" --concurrency 32 --num-prompts 64 --input-len 32:256 --output-len 128 \
      --seed 0 --warmup 1 --no-progress --out "$OUT/serve-batch-$sys-$r.json" >/dev/null
  kill -TERM $pid; wait $pid || true
  cd "$here"
}

for r in $(seq "$FIRST_ROUND" $((FIRST_ROUND + ROUNDS - 1))); do
  run_system A "$r"
  run_system B "$r"
done
echo "load after: $(cat /proc/loadavg)" >&2
"$PY" benchmarks/cpu/core_ab_summary.py "$OUT" --before "$BEFORE" ${AFTER:+--after "$AFTER"} \
    ${WHAT:+--what "$WHAT"} \
    --command "BEFORE=$BEFORE${AFTER:+ AFTER=$AFTER} ROUNDS=$ROUNDS bash benchmarks/cpu/run_core_ab.sh"
