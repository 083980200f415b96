"""One decode step of 64 sequences on the default model: LoRA off (the C++ decode stack, and
eager), and with rank-16 q/v adapters spread over 1, 8 and 32 distinct adapters (32 slots).
Best step time over ROUNDS rounds of 8 steps each, cases interleaved (a busy machine's noise
only ever adds time).

    .venv/bin/python benchmarks/cpu/lora_step.py [--rounds 2] [--adapter-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import time

from servelm.bench.lora_adapters import write_random_adapter
from servelm.config import EngineArgs
from servelm.engine_builder import build_engine
from servelm.protocol import EngineRequest, SamplingParams

CASES = [("LoRA off, C++ decode stack", 0, False), ("LoRA off, eager decode", 0, True),
         ("1 adapter", 1, False), ("8 adapters", 8, False), ("32 adapters", 32, False)]


def run(engine, k: int, eager_base: bool, tag: str, n_steps: int = 8) -> float:
    stack = engine.runner.cpu_stack
    if eager_base:
        engine.runner.cpu_stack = None
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    for i in range(64):
        engine.add_request(EngineRequest(f"{tag}-{i}", [100 + i + j for j in range(32)], params,
                                         lora_name=None if k == 0 else f"a{i % k}"))
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1
                                          for s in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(n_steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished:
        engine.step()
    engine.runner.cpu_stack = stack
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--adapter-dir", default="/tmp/servelm-lora-step")
    args = p.parse_args()
    engine = build_engine(EngineArgs(model="smollm2-135m-instruct", enable_lora=True,
                                     max_loras=32, num_threads=2, max_num_seqs=64,
                                     kv_cache_memory=512 * 2**20))
    for i in range(32):
        d = os.path.join(args.adapter_dir, f"a{i}")
        if not os.path.exists(os.path.join(d, "adapter_model.safetensors")):
            write_random_adapter(d, engine.model_config, 16, ("q_proj", "v_proj"), seed=i)
        engine.load_lora(f"a{i}", d)
    best: dict[str, float] = {}
    for rnd in range(args.rounds):
        for label, k, eager in CASES:
            best[label] = min(best.get(label, 1e9), run(engine, k, eager, f"{rnd}-{label}"))
        print(f"round {rnd} done, load {open('/proc/loadavg').read().split()[:3]}", flush=True)
    for label, _, _ in CASES:
        print(f"{label:28s} 64-sequence decode step, best of {args.rounds}x8: "
              f"{best[label] * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
