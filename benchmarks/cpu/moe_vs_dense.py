"""A mixture of experts against a dense model with the same active parameters, on this CPU.

The MoE is Qwen3-30B-A3B's shape scaled down (hidden 2048 -> --hidden, 48 -> --layers
layers, 128 experts of which 8 per token, expert width 768 scaled with the hidden size);
the dense model is Qwen3 with the same attention and an MLP as wide as the 8 chosen
experts together, so a token touches the same number of parameters in both. Both are
random-weight transformers checkpoints written to a temporary folder and served by servelm
in-process (float32). For each batch size the script times decode steps alone (prompts
prefilled first), counts the distinct experts each MoE layer read per step (the experts'
token counters before and after), and sets the weight bytes a step streams against
servelm/cost.py's figure (the planner's: expected experts touched under uniform routing)
and the time that many bytes take at --bandwidth.

    python benchmarks/cpu/moe_vs_dense.py --out benchmarks/results/moe-vs-dense-<ts>.json

Writes the JSON and a PNG next to it (tok/s and bytes per token against batch size).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def _checkpoints(root: Path, args) -> dict[str, Path]:
    import transformers

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  head_dim=args.hidden // args.heads, max_position_embeddings=4096,
                  tie_word_embeddings=False, rms_norm_eps=1e-6)
    expert = args.expert_width
    configs = {
        "moe": transformers.Qwen3MoeConfig(num_experts=args.experts,
                                           num_experts_per_tok=args.top_k,
                                           moe_intermediate_size=expert,
                                           intermediate_size=args.top_k * expert,
                                           norm_topk_prob=True, **common),
        "dense": transformers.Qwen3Config(intermediate_size=args.top_k * expert, **common),
    }
    paths = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        model = (transformers.Qwen3MoeForCausalLM if name == "moe"
                 else transformers.Qwen3ForCausalLM)(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.05)
        paths[name] = root / name
        model.save_pretrained(paths[name], safe_serialization=True)
        _word_tokenizer(paths[name], args.vocab)
        del model
    return paths


def _word_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def _expert_counters(engine) -> list[torch.Tensor]:
    from servelm.layers.moe import Experts

    return [m.num_routed_tokens.clone() for m in engine.runner.model.modules()
            if isinstance(m, Experts)]


def _decode_run(engine, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    from servelm.protocol import EngineRequest, SamplingParams

    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
        engine.add_request(EngineRequest(f"r{batch}-{i}", ids, SamplingParams(
            max_tokens=steps + 1, temperature=0.0, ignore_eos=True)))
    started: set[str] = set()
    while len(started) < batch:  # prefill (and each first token) outside the timing
        started.update(d.request_id for d in engine.step() if d.token_ids)
    touched, times = [], []
    while engine.has_unfinished:
        before = _expert_counters(engine)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        after = _expert_counters(engine)
        if before:
            touched.append(sum(int((a - b).gt(0).sum()) for a, b in zip(after, before))
                           / len(before))
    times = times[1:-1] or times  # the step that finishes may be short
    step_s = sorted(times)[len(times) // 2]
    return {"batch": batch, "decode_steps": len(times), "median_step_s": step_s,
            "decode_tok_s": batch / step_s,
            "experts_touched_per_layer": (sum(touched) / len(touched)) if touched else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-width", type=int, default=192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bandwidth", type=float, default=10.6e9,
                   help="bytes/s for the roofline column (default: the DRAM copy bandwidth "
                        "`servelm bench calibrate --host` measured on the CI machine)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from servelm import cost
    from servelm.bench.results import git_commit, machine_info
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine
    from servelm.loader import load_model_config, resolve_model

    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = _checkpoints(Path(tmp), args)
        variants = [("moe", paths["moe"], "auto"), ("dense", paths["dense"], "auto"),
                    ("dense-eager", paths["dense"], "decode=torch")]
        for label, path, kernels in variants:
            mc = load_model_config(resolve_model(str(path)))
            engine = build_engine(EngineArgs(model=str(path), num_threads=args.threads,
                                             max_num_seqs=max(batches), cpu_kernels=kernels,
                                             kv_cache_memory=1 << 30,
                                             prepared_weights_cache=False))
            params = cost.count_params(mc)
            for b in batches:
                r = _decode_run(engine, b, args.prompt_len, args.steps, args.vocab)
                planned = cost.weight_bytes_read_per_step(mc, b, 4.0)
                r.update(model=label, cpu_kernels=kernels, total_params=params.total,
                         active_params=params.active,
                         planned_weight_bytes_per_step=planned,
                         planned_weight_bytes_per_token=planned / b,
                         planned_experts_touched=cost.expected_experts_touched(mc, b),
                         roofline_step_s=planned / args.bandwidth)
                rows.append(r)
                print(f"[moe-vs-dense] {label:11s} batch {b:3d}: {r['decode_tok_s']:8.1f} tok/s"
                      f", step {r['median_step_s'] * 1e3:7.2f} ms (roofline "
                      f"{r['roofline_step_s'] * 1e3:6.2f} ms), experts/layer "
                      f"{r['experts_touched_per_layer']}", file=sys.stderr, flush=True)
            del engine
    result = {"kind": "moe_vs_dense", "command": " ".join(["python", *sys.argv]),
              "machine": machine_info(args.threads), "commit": git_commit(),
              "shape": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads",
                                                       "experts", "top_k", "expert_width",
                                                       "vocab")},
              "bandwidth_Bps": args.bandwidth, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.with_suffix(".png"))
    print(f"[moe-vs-dense] wrote {out}", file=sys.stderr)
    return 0


def _plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r["model"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["model"] == label]
        xs = [r["batch"] for r in rows]
        a.plot(xs, [r["decode_tok_s"] for r in rows], "o-", label=label)
        b.plot(xs, [r["planned_weight_bytes_per_token"] / 1e6 for r in rows], "o-", label=label)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch (sequences)")
        ax.legend(fontsize=8)
    a.set_ylabel("decode tokens/s")
    b.set_ylabel("weight MB streamed per token (cost model)")
    b.set_yscale("log")
    s = result["shape"]
    fig.suptitle(f"MoE ({s['experts']} experts, top {s['top_k']}) vs dense, same active "
                 f"params; {result['machine'].get('cpu', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
