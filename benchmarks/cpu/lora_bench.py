"""Multi-LoRA throughput on the CPU: N concurrent requests on the default model spread over
0, 1, 8, 64, 256 distinct random rank-R PEFT adapters, with as many slots as adapters and
with fewer, against LoRA off; memory per adapter and the arithmetic (extra FLOPs and bytes
per token per adapter). Writes JSON (+ a PNG) under benchmarks/results/.

    python benchmarks/cpu/lora_bench.py --num-requests 64 --output-len 64   (see run_lora.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

# adapters:slots; "off": LoRA off; "eager": LoRA off and the C++ decode stack off too (the
# path a step with adapter rows takes, without the adapters)
CASES = "off,eager,0:4,1:1,8:8,8:4,64:32,64:8,256:32,256:8"


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _prompts(tokenizer, n: int, input_len: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    vocab = tokenizer.vocab_size if tokenizer is not None else 32000
    return [[rng.randrange(100, min(vocab, 30000)) for _ in range(input_len)] for _ in range(n)]


def run_case(args, config, adapter_dirs, num_adapters: int | None, num_slots: int,
             eager: bool = False) -> dict:
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine
    from servelm.llm import LLM
    from servelm.protocol import SamplingParams

    extra = {"cpu_kernels": "decode=torch"} if eager else {}
    if num_adapters is not None:
        extra = dict(enable_lora=True, max_loras=num_slots, max_lora_rank=args.rank)
    engine = build_engine(EngineArgs(model=args.model, num_threads=args.threads,
                                     max_num_seqs=args.num_requests,
                                     kv_cache_memory=args.kv_cache_mib * 2**20, **extra))
    names: list[str | None] = [None] * args.num_requests
    if num_adapters:
        for i in range(num_adapters):
            engine.load_lora(f"a{i}", adapter_dirs[i])
        names = [f"a{i % num_adapters}" for i in range(args.num_requests)]
    llm = LLM(engine=engine)
    prompts = _prompts(engine.tokenizer, args.num_requests, args.input_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), lora=names[:2], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=names, use_tqdm=False)
    wall = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"adapters": num_adapters, "slots": num_slots if num_adapters is not None else None,
           "lora": num_adapters is not None, "eager": eager, "wall_s": round(wall, 3),
           "output_tokens": num_out, "output_tok_s": round(num_out / wall, 2),
           "steps": engine.stats.num_steps}
    manager = engine.runner.lora
    if manager is not None:
        row.update(lora_steps=manager.num_lora_steps, slot_bytes=manager.slot_bytes,
                   loads=engine.loras.num_loads, evictions=engine.loras.num_evictions,
                   host_bytes_per_adapter=(next(iter(manager.host.values())).num_bytes
                                           if manager.host else 0))
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def arithmetic(config, rank: int, targets: list[str]) -> dict:
    from servelm.cost import matmul_flops_per_token
    from servelm.lora.manager import lora_flops_per_token, lora_params

    extra = lora_flops_per_token(config, rank, targets)
    base = matmul_flops_per_token(config)
    params = lora_params(config, rank, targets)
    return {"rank": rank, "targets": targets, "lora_params": params,
            "lora_bytes_fp32": params * 4, "extra_flops_per_token": extra,
            "base_matmul_flops_per_token": base,
            "extra_flops_share": round(extra / base, 5),
            # each distinct adapter in a step is read once per step (like the base weights)
            "extra_bytes_per_step_per_adapter": params * 4}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["lora"] and r["adapters"]]
    off = next((r for r in result["rows"] if not r["lora"] and not r["eager"]), None)
    eager = next((r for r in result["rows"] if r["eager"]), None)
    fig, ax = plt.subplots(figsize=(7, 4))
    for slots_full in (True, False):
        pts = [r for r in rows if (r["slots"] >= r["adapters"]) == slots_full]
        if pts:
            ax.plot([r["adapters"] for r in pts], [r["output_tok_s"] for r in pts], "o-",
                    label="slots >= adapters" if slots_full else "slots < adapters")
    if off is not None:
        ax.axhline(off["output_tok_s"], color="gray", ls="--", label="LoRA off")
    if eager is not None:
        ax.axhline(eager["output_tok_s"], color="gray", ls=":",
                   label="LoRA off, eager decode (no C++ stack)")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("distinct adapters among the requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result['model']}: {result['num_requests']} requests, rank {result['rank']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--cases", default=CASES, help="comma list of adapters:slots, or off")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--adapter-dir", default=None, help="where the random adapters go")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from servelm.bench.lora_adapters import write_random_adapter
    from servelm.bench.results import machine_info
    from servelm.loader import load_model_config, resolve_model

    config = load_model_config(resolve_model(args.model))
    targets = args.targets.split(",")
    cases = []
    for item in args.cases.split(","):
        if item in ("off", "eager"):
            cases.append((None, 0, item == "eager"))
        else:
            n, s = item.split(":")
            cases.append((int(n), int(s), False))
    most = max((n or 0) for n, _, _ in cases)
    root = args.adapter_dir or tempfile.mkdtemp(prefix="servelm-lora-bench-")
    dirs = []
    for i in range(most):
        d = os.path.join(root, f"a{i}")
        if not os.path.exists(os.path.join(d, "adapter_model.safetensors")):
            write_random_adapter(d, config, args.rank, tuple(targets), seed=i)
        dirs.append(d)
    result = {"benchmark": "lora-throughput", "command": " ".join([sys.executable] + sys.argv),
              "cpu_model": _cpu_model(), "num_cpus": os.cpu_count(), "commit": _commit(),
              "machine": machine_info(args.threads),
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "loadavg_before": open("/proc/loadavg").read().split()[:3],
              "model": args.model, "num_requests": args.num_requests,
              "input_len": args.input_len, "output_len": args.output_len, "rank": args.rank,
              "threads": args.threads, "arithmetic": arithmetic(config, args.rank, targets),
              "adapter_file_bytes": (os.path.getsize(os.path.join(dirs[0],
                                                                  "adapter_model.safetensors"))
                                     if dirs else 0),
              "rows": []}
    for n, s, eager in cases:
        result["rows"].append(run_case(args, config, dirs, n, s, eager))
    result["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
