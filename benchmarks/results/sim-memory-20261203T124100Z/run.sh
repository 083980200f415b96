set -euo pipefail
cd /work/main
FLEET=(--gpu H100-SXM --model Llama-3.1-70B --tp 8 --policy least_loaded --input-len 2000 --output-len 300 --max-num-seqs 555 --max-num-batched-tokens 1369 --slo-ttft-ms 1000 --slo-tpot-ms 50)
for n in 40000 120000; do
  .venv/bin/python -m servelm.cli sim "${FLEET[@]}" --num-replicas 80 --request-rate 1000 --num-prompts $n --out /tmp/simrun/mem-80-$n.json > /dev/null 2>/tmp/simrun/mem-80-$n.log
done
.venv/bin/py-spy record -o /tmp/simrun/prof.txt -f raw -r 100 -- .venv/bin/python -m servelm.cli sim "${FLEET[@]}" --num-replicas 80 --request-rate 1000 --num-prompts 40000 --out /tmp/simrun/prof-80.json > /dev/null 2>/tmp/simrun/prof.log
echo after-done
