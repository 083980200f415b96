"""How fast the offline batch could run on this CPU: the workload's arithmetic and memory
traffic against the machine's measured bfloat16 GEMM rate and memory bandwidth, beside what
engines measured on it.

Counts, for the default model (read from its config) and the best-against-best batch (64
prompts of 32..256 tokens, seed 0, 128 new tokens each, greedy): the linears' multiply-adds
(prefill rows skip the head except each prompt's last; decode rows run it), attention's
(causal in prefill, the whole context in decode) and the bytes a decode step must read
(weights once a step, every sequence's K/V once a layer). Measures here, 2 threads: oneDNN's
bfloat16 GEMM on a large square problem (the machine's practical peak) and on the model's
own decode-step shapes (64 rows, weights packed once), and the read bandwidth of a 1 GiB sum.

The bound: prefill at the peak rate, plus each decode step at max(its multiply-adds at the
peak, its bytes at the bandwidth): no norms, sampling, scheduling or imbalance. Writes
roofline.json (command, machine, commit) and roofline.png into --out.

    .venv/bin/python benchmarks/cpu/roofline.py --out DIR [--measured RECORD_DIR]

--measured: a best-vs-best record whose summary.json gives the engines' output tok/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from servelm.bench.results import git_commit, machine_info
from servelm.bench.workloads import random_lengths
from servelm.loader import load_model_config, resolve_model

MODEL = "smollm2-135m-instruct"


def _rate(fn, flops: float, seconds: float = 1.0) -> float:
    for _ in range(3):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return flops * n / (time.perf_counter() - t0)


def gemm_rates(cfg) -> dict:
    """GFLOP/s of oneDNN's bfloat16 GEMM: large square, and the model's decode shapes."""
    lin = torch.ops.mkldnn._linear_pointwise
    out = {}
    a, b = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    out["square_2048"] = _rate(lambda: a @ b, 2 * 2048 ** 3) / 1e9
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i),
              "head": (cfg.vocab_size, h)}
    for name, (n, k) in shapes.items():
        w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), None)
        x = torch.randn(64, k).bfloat16()
        out[f"decode_64_{name}"] = _rate(lambda: lin(x, w, None, "none", [], ""),
                                         2 * 64 * n * k, 0.5) / 1e9
    return out


def read_bandwidth() -> float:
    x = torch.ones(2 ** 28)  # 1 GiB of float32
    return _rate(x.sum, x.numel() * 4) / 1e9  # GB/s


def workload_counts(cfg, prompt_lens: list[int], new_tokens: int) -> dict:
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h  # multiply-adds a row, one layer
    head = cfg.vocab_size * h
    attn_per_pair = 2 * cfg.num_heads * cfg.head_dim  # q.k and p.v, one query-key pair
    prompt_rows = sum(prompt_lens)
    prefill = 2 * (prompt_rows * L * layer + len(prompt_lens) * head
                   + sum(n * (n + 1) // 2 for n in prompt_lens) * L * attn_per_pair)
    kv_bytes_per_token = 2 * L * kv * 2  # K and V, bfloat16
    weight_bytes = 2 * (L * layer + head)
    steps = []
    for s in range(1, new_tokens):  # the first new token comes out of the prefill
        ctx = sum(n + s for n in prompt_lens)  # positions attended this step
        flops = 2 * (len(prompt_lens) * (L * layer + head) + ctx * L * attn_per_pair)
        steps.append({"flops": flops, "bytes": weight_bytes + ctx * kv_bytes_per_token})
    return {"prefill_flops": prefill, "decode_steps": steps,
            "decode_flops": sum(s["flops"] for s in steps),
            "decode_bytes": sum(s["bytes"] for s in steps),
            "output_tokens": len(prompt_lens) * new_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--measured", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_model_config(resolve_model(MODEL))
    requests = random_lengths(64, (32, 256), (128, 128), cfg.vocab_size, 0)
    counts = workload_counts(cfg, [len(r.prompt_token_ids) for r in requests], 128)
    print("measuring the GEMM rates and the bandwidth...", file=sys.stderr)
    rates, bw = gemm_rates(cfg), read_bandwidth()
    peak = rates["square_2048"] * 1e9
    prefill_s = counts["prefill_flops"] / peak
    decode_s = sum(max(s["flops"] / peak, s["bytes"] / (bw * 1e9))
                   for s in counts["decode_steps"])
    bound_tok_s = counts["output_tokens"] / (prefill_s + decode_s)
    record = {"kind": "roofline", "command": "python " + " ".join(sys.argv),
              "machine": machine_info(args.threads), "commit": git_commit(), "model": MODEL,
              "workload": "64 x (32:256 + 128), seed 0", "gemm_gflop_s": rates,
              "read_gb_s": bw, "prefill_tflop": counts["prefill_flops"] / 1e12,
              "decode_tflop": counts["decode_flops"] / 1e12,
              "decode_gb": counts["decode_bytes"] / 1e9, "bound_prefill_s": prefill_s,
              "bound_decode_s": decode_s, "bound_output_tok_s": bound_tok_s}
    if args.measured:
        summary = json.loads((Path(args.measured) / "summary.json").read_text())
        record["measured_record"] = args.measured
        record["measured"] = _measured(summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "roofline.json").write_text(json.dumps(record, indent=1))
    _plot(record, out / "roofline.png")
    print(json.dumps({k: v for k, v in record.items() if k not in ("machine",)}, indent=1))


def _measured(summary: dict) -> dict:
    """{system: batch output tok/s} from a best-vs-best summary.json (its `systems` rows)."""
    found = {}
    for row in summary["systems"]:
        batch = row.get("batch") or {}
        if batch.get("output_tok_s") and row["key"] in ("default", "vllm-bf16", "vllm",
                                                         "llama-server"):
            found[row["system"]] = batch["output_tok_s"]
    return found


def _plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = {"bound (peak GEMM, bandwidth)": record["bound_output_tok_s"]}
    bars.update(record.get("measured", {}))
    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(bars)
    b = ax.barh(names, [bars[n] for n in names])
    ax.bar_label(b, fmt="%.0f", fontsize=8)
    ax.set_xlabel("output tok/s, 64 x (32:256 + 128)")
    ax.set_title(f"{record['model']} on {record['machine'].get('cpu', 'CPU')}, "
                 f"{record['machine'].get('threads')} threads: "
                 f"GEMM peak {record['gemm_gflop_s']['square_2048']:.0f} GFLOP/s, "
                 f"read {record['read_gb_s']:.0f} GB/s", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
