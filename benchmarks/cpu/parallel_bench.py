"""Tensor parallelism on the CPU over gloo: what a step's communication costs, and whether
TP pays at the same total cores. Writes JSON (+ a PNG) under benchmarks/results/.

    1. all-reduce microbenchmark: two processes, one core each, gloo all_reduce of
       [tokens, hidden] float32 for decode-sized messages: microseconds per call.
    2. decode on the default model in float32 (--dtype), 2 cores in all: TP=1 with 2
       threads and TP=2 with 1 thread per rank, each on the C++ decode stack (under TP its
       all-reduces run inside it, servelm/parallel/decode_stack.py) and on the eager path
       (--cpu-kernels decode=torch); one stream (128 prompt tokens, 128 new) and 64 streams
       (32-256 prompt tokens, 64 new); decode tok/s counted once every request has its
       first token. Each run records the decode path it took (stack | eager).
    3. in the TP=2 decodes: bytes all-reduced per token per layer (servelm/parallel/group.py's
       count, the stack's included) against the planner's formula (servelm/planner/
       tp_comm.py), and the seconds spent in all-reduces (waiting for the other rank
       included; timed in C++ on the stack) per decode step.

    python benchmarks/cpu/parallel_bench.py            (see run_parallel.sh)
    python benchmarks/cpu/parallel_bench.py --quick    (tiny sizes: checks that it runs)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

HIDDEN = 576  # the default model's (SmolLM2-135M)


def _allreduce_worker(rank: int, port: int, sizes: list[int], iters: int) -> list[dict]:
    import torch

    from servelm.config import ParallelConfig
    from servelm.parallel.group import ParallelGroup

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % os.cpu_count()]})
    torch.set_num_threads(1)
    group = ParallelGroup.join(rank, ParallelConfig(tensor_parallel_size=2),
                               torch.device("cpu"), "127.0.0.1", port, 60.0)
    out = []
    for tokens in sizes:
        t = torch.randn(tokens, HIDDEN)
        for _ in range(20):
            group.all_reduce(t)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            group.all_reduce(t)
            times.append(time.perf_counter() - start)
        times.sort()
        nbytes = t.numel() * 4
        out.append({"tokens": tokens, "bytes": nbytes,
                    "median_us": times[len(times) // 2] * 1e6,
                    "p90_us": times[int(len(times) * 0.9)] * 1e6,
                    "algbw_GBps": nbytes / times[len(times) // 2] / 1e9})
    group.leave()
    return out


def allreduce_bench(sizes: list[int], iters: int) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = subprocess.Popen([sys.executable, __file__, "--allreduce-rank", "1", "--port",
                             str(port), "--sizes", ",".join(map(str, sizes)), "--iters",
                             str(iters)])
    saved = os.sched_getaffinity(0)
    try:
        return _allreduce_worker(0, port, sizes, iters)
    finally:
        os.sched_setaffinity(0, saved)
        peer.wait(60)


def decode_run(model: str, tp: int, cpu_kernels: str, num_prompts: int, input_len: tuple,
               output_len: int, dtype: str, seed: int = 0) -> dict:
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine
    from servelm.protocol import EngineRequest, SamplingParams

    engine = build_engine(EngineArgs(model=model, tensor_parallel_size=tp, num_threads=2,
                                     cpu_kernels=cpu_kernels, max_num_seqs=64, dtype=dtype,
                                     kv_cache_memory=512 * 2**20, enable_prefix_caching=False))
    rng = random.Random(seed)
    for i in range(num_prompts):
        n = rng.randint(*input_len)
        ids = [rng.randrange(100, engine.vocab_size) for _ in range(n)]
        engine.add_request(EngineRequest(f"r{i}", ids, SamplingParams(
            max_tokens=output_len, temperature=0.0, ignore_eos=True)))
    started: set[str] = set()
    decode_start = decode_tokens = decode_steps = 0
    group = getattr(engine.runner, "group", None)
    start = time.perf_counter()
    while engine.has_unfinished:
        deltas = engine.step()
        if len(started) < num_prompts:
            started |= {d.request_id for d in deltas if d.token_ids}
            if len(started) == num_prompts:  # every request past its prefill: decode only
                decode_start = time.perf_counter()
                if group is not None:
                    group.stats.reset()
            continue
        decode_tokens += sum(len(d.token_ids) for d in deltas)
        decode_steps += 1
    end = time.perf_counter()
    out = {"tp": tp, "cpu_kernels": cpu_kernels, "dtype": dtype,
           "decode_path": "stack" if engine.runner.cpu_stack is not None else "eager",
           "num_prompts": num_prompts,
           "output_len": output_len, "total_s": end - start,
           "decode_s": end - decode_start, "decode_steps": decode_steps,
           "decode_tok_s": decode_tokens / (end - decode_start) if decode_tokens else None}
    if group is not None:
        s, cfg = group.stats, engine.model_config
        from servelm.planner.tp_comm import allreduce_bytes_per_step

        out["comm"] = {
            "all_reduce_calls": s.all_reduce_calls, "all_reduce_bytes": s.all_reduce_bytes,
            # per layer: the step's bytes per token less the embedding's one reduction
            "bytes_per_token_per_layer": (s.all_reduce_bytes / decode_tokens
                                          - cfg.hidden_size * 4) / cfg.num_layers,
            "planner_bytes_per_token_per_layer": (allreduce_bytes_per_step(
                cfg.hidden_size, cfg.num_layers, 1, 4) - cfg.hidden_size * 4) / cfg.num_layers,
            "all_reduce_s_per_decode_step": s.all_reduce_s / decode_steps,
            "decode_step_s": (end - decode_start) / decode_steps,
            "us_per_all_reduce": s.all_reduce_s / s.all_reduce_calls * 1e6,
        }
        engine.runner.close()
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ar = result["allreduce"]
    a.plot([r["tokens"] for r in ar], [r["median_us"] for r in ar], "o-")
    a.set_xscale("log")
    a.set_xlabel(f"tokens x {HIDDEN} float32")
    a.set_ylabel("gloo all-reduce, median us (2 ranks)")
    runs = result["decode"]
    labels = [f"{r['label']}\n{r['num_prompts']} stream(s)" for r in runs]
    b.bar(range(len(runs)), [r["decode_tok_s"] or 0 for r in runs])
    b.set_xticks(range(len(runs)), labels, fontsize=7, rotation=20)
    b.set_ylabel("decode tok/s (2 cores in all)")
    fig.suptitle(f"tensor parallel on the CPU, {result['model']} ({result['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a check that it runs)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--allreduce-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="1,8,64,256")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--dtype", default="float32", help="the model's (float32: as the records "
                   "before bfloat16 were)")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.allreduce_rank is not None:
        _allreduce_worker(a.allreduce_rank, a.port, sizes, a.iters)
        return 0
    sys.path.insert(0, os.getcwd())
    from servelm.bench.results import git_commit, machine_info

    ts = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_dir = a.out_dir or os.path.join("benchmarks", "results", f"parallel-{ts}")
    os.makedirs(out_dir, exist_ok=True)
    iters = 30 if a.quick else a.iters
    result = {"command": " ".join(sys.argv), "machine": machine_info(2),
              "commit": git_commit(), "model": a.model, "when": ts,
              "allreduce": allreduce_bench(sizes, iters), "decode": []}
    single = (1, (128, 128), 128) if not a.quick else (1, (16, 16), 8)
    batch = (64, (32, 256), 64) if not a.quick else (4, (8, 32), 4)
    for label, tp, kernels in (("TP=1 C++ stack", 1, "auto"),
                               ("TP=1 eager", 1, "decode=torch"),
                               ("TP=2 C++ stack", 2, "auto"),
                               ("TP=2 eager", 2, "decode=torch")):
        for n, lens, out_len in (single, batch):
            run = decode_run(a.model, tp, kernels, n, lens, out_len, a.dtype)
            run["label"] = label
            print(json.dumps(run), flush=True)
            result["decode"].append(run)
    with open(os.path.join(out_dir, "parallel.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(out_dir, "parallel.png"))
    print(f"wrote {out_dir}/parallel.json and parallel.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
