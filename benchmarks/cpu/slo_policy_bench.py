"""Measure one running server under a mix of SLO classes: Poisson arrivals of the same
requests `servelm sim --class-mix` simulates (servelm/slo.py class_workload, same seed), each
sent with its `slo_class`, streamed; prints and writes per-class goodput (an early 429 counts
as a rejection, against the class's goodput).

    python benchmarks/cpu/slo_policy_bench.py --base-url URL --slo-spec FILE \
        --class-mix interactive=0.7,batch=0.3 --class-len interactive=64:256/32:64 \
        --class-len batch=1000:2000/128:256 --request-rate 1 --num-prompts 60 --out OUT.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace

from servelm.bench.loadgen import EndpointConfig, arrival_offsets, make_client, stream_request
from servelm.bench.metrics import RequestRecord
from servelm.slo import (SLOSpec, class_workload, goodput_by_class, parse_class_lengths,
                         parse_class_mix)


async def run(args, spec: SLOSpec) -> tuple[list[RequestRecord], list[str]]:
    reqs, classes = class_workload(args.num_prompts, parse_class_mix(args.class_mix, spec),
                                   parse_class_lengths(args.class_len, spec), args.input_len,
                                   args.output_len, args.vocab_size, args.seed)
    offsets = arrival_offsets(len(reqs), args.request_rate, "poisson", seed=args.seed)
    base = EndpointConfig(args.base_url, args.model)
    cfgs = {c: replace(base, extra_body={"slo_class": c}) for c in spec.names}
    records = [RequestRecord(len(r.prompt_token_ids), r.max_tokens) for r in reqs]
    async with make_client(base, len(reqs)) as client:
        start = time.perf_counter()

        async def one(i):
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            records[i].scheduled_time = start + offsets[i]
            await stream_request(client, cfgs[classes[i]], reqs[i], records[i])
            if records[i].error == "http_429" and "slo_unattainable" in (
                    records[i].error_detail or ""):
                records[i].error = "slo_unattainable"

        await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return records, classes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--slo-spec", required=True)
    p.add_argument("--class-mix", required=True)
    p.add_argument("--class-len", action="append", default=None)
    p.add_argument("--input-len", default="128")
    p.add_argument("--output-len", default="64")
    p.add_argument("--request-rate", type=float, required=True)
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="servelm")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    spec = SLOSpec.load(args.slo_spec)
    records, classes = asyncio.run(run(args, spec))
    by_class = goodput_by_class(spec, records, classes)
    with open(args.out, "w") as f:
        json.dump({"kind": "slo-policy-measured", "label": args.label, "args": vars(args),
                   "by_class": by_class,
                   "errors": sorted({r.error for r in records if r.error})}, f, indent=2)
    for name, row in by_class.items():
        print(f"{args.label:<10} {name:<12} requests {row['num_requests']:>4}  met "
              f"{row['num_met']:>4}  rejected {row['num_rejected']:>4}  goodput "
              f"{(row['goodput'] or 0):6.1%} (target {row['target']:.0%})")


if __name__ == "__main__":
    main()
