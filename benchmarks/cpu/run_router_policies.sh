#!/usr/bin/env bash
# The routing-policy comparison in docs/benchmarks.md: the same multi-turn workload against
# 2 replicas of the default model (`servelm serve --data-parallel-size 2`, 1 thread each), once
# per policy, in one run; a fresh pair of replicas for each policy so that no policy inherits
# another's cache. Each replica's KV pool (KV_MEMORY) is smaller than what every live
# conversation's history needs at once, the way a busy deployment's is: the case where a
# conversation's next turn goes decides whether its history is still cached.
#   bash benchmarks/cpu/run_router_policies.sh
#   POLICIES=round_robin,prefix_affinity CONVERSATIONS=16 ... a shorter run
# Run it from a clean worktree of the commit to measure (git worktree add --detach DIR HEAD; the
# current directory comes first on sys.path, before the editable install), with PY=<venv python>.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$PWD/.venv/bin/python}
TS=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT_DIR:-$PWD/benchmarks/results/router-policies-$TS}
POLICIES=${POLICIES:-round_robin,least_loaded,session,prefix_affinity}
CONVERSATIONS=${CONVERSATIONS:-24}
RATE=${RATE:-0.4}
THINK=${THINK:-4}
KV_MEMORY=${KV_MEMORY:-160MiB}
SYSTEM=${SYSTEM:-64}
USER_LEN=${USER_LEN:-32:96}
OUTPUT_LEN=${OUTPUT_LEN:-16:32}
TURNS=${TURNS:-4:8}
MODEL=smollm2-135m-instruct
mkdir -p "$OUT"
echo "load before: $(cat /proc/loadavg)" >&2
for policy in ${POLICIES//,/ }; do
  port=$((18000 + RANDOM % 1000))
  "$PY" -m servelm.cli serve $MODEL --port $port --data-parallel-size 2 --threads 1 \
      --router-policy "$policy" --kv-cache-memory "$KV_MEMORY" --max-model-len 4096 \
      --no-log-requests 2>"$OUT/serve-$policy.log" &
  pid=$!
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$port/health" | grep -q '"healthy_replicas":2' && break
    kill -0 $pid 2>/dev/null || { echo "servelm serve failed: see $OUT/serve-$policy.log" >&2; exit 1; }
    sleep 0.2
  done
  echo "[router-policies] $policy" >&2
  "$PY" -m servelm.cli bench multiturn --base-url "http://127.0.0.1:$port" --model $MODEL \
      --label "$policy" --num-conversations "$CONVERSATIONS" --system-prompt-len "$SYSTEM" \
      --user-len "$USER_LEN" --output-len "$OUTPUT_LEN" --turns "$TURNS" --conversation-rate "$RATE" \
      --think-time "$THINK" --seed 0 --no-progress --out "$OUT/$policy.json" \
      > "$OUT/$policy.txt"
  kill -TERM $pid; wait $pid || true
done
echo "load after: $(cat /proc/loadavg)" >&2
"$PY" benchmarks/cpu/router_policies_summary.py "$OUT" \
    --command "POLICIES=$POLICIES CONVERSATIONS=$CONVERSATIONS RATE=$RATE THINK=$THINK KV_MEMORY=$KV_MEMORY SYSTEM=$SYSTEM USER_LEN=$USER_LEN OUTPUT_LEN=$OUTPUT_LEN TURNS=$TURNS bash benchmarks/cpu/run_router_policies.sh"
