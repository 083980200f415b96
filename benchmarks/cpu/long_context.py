"""TTFT and decode step time against context length (1k to 128k tokens) on a tiny
random-weight model with a 128k context (llama3 rope scaling), and what a long prefill
costs the other streams.

For each context length L: one L-token prompt alone (TTFT; prefill in --budget-token
chunks), then 16 decode steps at context L (step time), then the same prompt while
--num-streams short requests decode beside it (their largest gap between tokens while the
prefill runs: the stall a long prompt costs the others under the token budget). Also per
L: the KV blocks it holds against the pool (capacity) and the seconds per step the
scheduler and engine take outside the runner (the scheduler's cost at long contexts).

    .venv/bin/python benchmarks/cpu/long_context.py \
        --out-dir benchmarks/results/long-context-$(date -u +%Y%m%dT%H%M%SZ)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from servelm.bench.results import git_commit, machine_info
from servelm.protocol import EngineRequest, SamplingParams


def tiny_engine(max_len: int, budget: int, threads: int):
    import torch
    import transformers

    from servelm.config import EngineArgs, ModelConfig
    from servelm.engine_builder import assemble_engine

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=max_len + 256,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    hf = transformers.LlamaForCausalLM(cfg).eval()
    config = ModelConfig.from_hf_config(cfg.to_dict())
    args = EngineArgs(model="tiny-128k", block_size=16, num_blocks=(max_len + 4096) // 16,
                      max_num_batched_tokens=budget, num_threads=threads)
    return assemble_engine(args, config, hf.state_dict().items(), None, "tiny-128k")


def _params(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def measure(engine, length: int, num_streams: int, rng) -> dict:
    sched_s = []
    schedule = engine.scheduler.schedule

    def timed():
        t = time.perf_counter()
        out = schedule()
        sched_s.append(time.perf_counter() - t)
        return out

    engine.scheduler.schedule = timed
    prompt = [rng.randrange(3, 250) for _ in range(length)]
    engine.add_request(EngineRequest(f"long-{length}", prompt, _params(17)))
    step_times, blocks, ttft_s, first_seen = [], 0, None, False
    while engine.has_unfinished:
        t = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t
        blocks = max(blocks, engine.block_manager.num_used_blocks)
        if first_seen:  # every step after the first token is one decode at context ~L
            step_times.append(dt)
        first_seen = first_seen or bool(deltas)
        ttft_s = next((d.timings.ttft_s for d in deltas if d.timings is not None), ttft_s)
    engine.scheduler.schedule = schedule
    stall = stalled_prefill(engine, length, num_streams, rng)
    return {"context_tokens": length, "ttft_s": ttft_s,
            "decode_step_s": sorted(step_times)[len(step_times) // 2] if step_times else None,
            "blocks_held": blocks, "pool_blocks": engine.block_manager.num_blocks,
            "schedule_s_per_step": sum(sched_s) / len(sched_s), **stall}


def stalled_prefill(engine, length: int, num_streams: int, rng) -> dict:
    """The long prompt arrives while short streams decode: their worst token gap."""
    for i in range(num_streams):  # they decode until aborted below
        short = [rng.randrange(3, 250) for _ in range(32)]
        engine.add_request(EngineRequest(f"s{length}-{i}", short,
                                         _params(engine.max_model_len - 64)))
    for _ in range(4):
        engine.step()
    engine.add_request(EngineRequest(f"L{length}", [rng.randrange(3, 250)
                                                    for _ in range(length)], _params(1)))
    last, worst, t0 = time.perf_counter(), 0.0, time.perf_counter()
    done = False
    while not done:
        deltas = engine.step()
        now = time.perf_counter()
        if any(d.request_id.startswith("s") for d in deltas):
            worst, last = max(worst, now - last), now
        done = any(d.request_id == f"L{length}" for d in deltas)
    for i in range(num_streams):
        engine.abort(f"s{length}-{i}")
    while engine.has_unfinished:
        engine.step()
    return {"stall_max_gap_s": worst, "stall_prefill_s": time.perf_counter() - t0}


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["context_tokens"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [r["ttft_s"] for r in rows], marker="o", label="TTFT (alone)")
    a.plot(xs, [r["stall_max_gap_s"] for r in rows], marker="s",
           label="other streams' worst gap")
    a.set_xscale("log", base=2), a.set_yscale("log"), a.set_xlabel("context tokens")
    a.set_ylabel("seconds"), a.legend()
    b.plot(xs, [r["decode_step_s"] * 1e3 for r in rows], marker="o", label="decode step")
    b.plot(xs, [r["schedule_s_per_step"] * 1e3 for r in rows], marker="s",
           label="scheduler per step")
    b.set_xscale("log", base=2), b.set_xlabel("context tokens"), b.set_ylabel("ms")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536,131072")
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--num-streams", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    engine = tiny_engine(max(lengths), args.budget, args.threads)
    rng = random.Random(0)
    rows = []
    for n in lengths:
        rows.append(measure(engine, n - 32, args.num_streams, rng))
        print(json.dumps(rows[-1]), flush=True)
    result = {"kind": "long-context", "command": " ".join(sys.argv),
              "machine": machine_info(args.threads), "commit": git_commit(),
              "model": "tiny llama, 1 layer, 2 heads / 1 KV head x 8, llama3 rope x8",
              "wall_s": time.time() - start, "args": vars(args), "rows": rows}
    (out_dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, out_dir / "long_context.png")
    print(f"wrote {out_dir}/result.json, long_context.png in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
