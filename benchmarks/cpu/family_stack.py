"""Every family's decode speed on the C++ decode stack against the eager path, on this CPU.

Each family is a random-weight transformers model at one base shape (--hidden, --layers,
--heads, --kv-heads, --intermediate; about 200M parameters by default, the MoE families'
experts sized so that a token reads about what the dense MLP holds) with its own features
on: Qwen2's biases, Qwen3's q/k norms, Mistral's and Phi-3's windows, Gemma 2's soft-caps,
sandwich norms, GeGLU and alternating windows, Gemma 3's q/k norms and local rope, the
MoE routings. Each is served in-process twice, `--cpu-kernels decode=kernel` (the stack
where the family takes it; the start-up refusal is recorded where not) and `decode=torch`
(eager), in float32 and, where the CPU has avx512_bf16, bfloat16. For each batch size the
median decode step (prompts prefilled first, outside the timing) gives tok/s, and

    weight bytes/s = steps/s x weight bytes a step reads (servelm/cost.py: the layers, the
                     experts its tokens are expected to touch, the head)

relative to the Llama model of the same base shape in the same dtype, batch and path: the
goal is every family within 20% of it (>= 0.8).

    .venv/bin/python benchmarks/cpu/family_stack.py --out benchmarks/results/family-stack-<ts>
    .venv/bin/python benchmarks/cpu/family_stack.py --out /tmp/x --tiny   (a dry run)

--rounds N measures every family N times, the families in a rotated order each round (the
machine's drift then lands on a different family each time), and keeps each cell's median
step, with the rounds' tok/s beside it.

Writes family-stack.json (command, machine, commit, per family, dtype, path and batch: tok/s,
median step, bytes per step, the ratio) and family-stack.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

# family -> (transformers config class, model class, config overrides at the base shape)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 64}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"sliding_window": 64, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "query_pre_attn_scalar": "head_dim",
                "tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": 64, "query_pre_attn_scalar": "head_dim",
                "tie_word_embeddings": True}),
    # experts: 8 of width I/2, 2 a token (Mixtral); 16 of I/4, 4 a token, and a shared one
    # of width I (Qwen2-MoE); Qwen3-MoE without the shared one
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": "I/2"}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": "I/4",
                   "shared_expert_intermediate_size": "I", "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": "I/4",
                   "norm_topk_prob": True}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    {"n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4,
                     "moe_intermediate_size": "I/4", "first_k_dense_replace": 1,
                     "kv_lora_rank": 256, "q_lora_rank": None, "qk_rope_head_dim": 32,
                     "qk_nope_head_dim": 64, "v_head_dim": 64, "topk_method": "greedy",
                     "n_group": 1, "topk_group": 1}),
}


def _hf_model(family: str, args):
    import transformers
    try:  # skip the random init: every weight is drawn below
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights

    cfg_name, model_name, extra = FAMILIES[family]
    head_dim = args.hidden // args.heads
    sizes = {"head_dim": head_dim, "I": args.intermediate, "I/2": args.intermediate // 2,
             "I/4": args.intermediate // 4}
    kwargs = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                  intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  head_dim=head_dim, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update({k: sizes.get(v, v) if isinstance(v, str) else v for k, v in extra.items()})
    config = getattr(transformers, cfg_name)(**kwargs)
    with no_init_weights():
        model = getattr(transformers, model_name)(config).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
            elif "norm" in name:
                p.fill_(0.0 if family.startswith("gemma") else 1.0)  # Gemma scales by 1 + w
            else:
                p.zero_()
    return model


def _engine(hf, dtype: str, decode: str, max_seqs: int):
    from servelm.config import EngineArgs, ModelConfig
    from servelm.engine_builder import assemble_engine

    config = ModelConfig.from_hf_config(hf.config.to_dict())
    args = EngineArgs(model="family-stack", dtype=dtype, cpu_kernels=f"decode={decode}",
                      max_num_seqs=max_seqs, num_blocks=max_seqs * 24, block_size=16)
    return assemble_engine(args, config, hf.state_dict().items(), None, "family-stack")


def _median_step(engine, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    from servelm.protocol import EngineRequest, SamplingParams

    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
        engine.add_request(EngineRequest(f"r{batch}-{i}-{time.monotonic_ns()}", ids,
                                         SamplingParams(max_tokens=steps + 1, temperature=0.0,
                                                        ignore_eos=True)))
    started: set[str] = set()
    while len(started) < batch:  # prefill (and each first token) outside the timing
        started.update(d.request_id for d in engine.step() if d.token_ids)
    times = []
    while engine.has_unfinished:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    times = times[1:-1] or times  # the step that finishes may be short
    return sorted(times)[len(times) // 2]


def measure(family: str, args, dtypes: list[str], batches: list[int]) -> list[dict]:
    from servelm import cost

    hf = _hf_model(family, args)
    rows = []
    for dtype in dtypes:
        for decode in ("kernel", "torch"):
            engine = _engine(hf, dtype, decode, max(batches))
            mc = engine.model_config
            stack = engine.runner.cpu_stack
            nbytes = 2 if dtype == "bfloat16" else 4
            for b in batches:
                before = 0 if stack is None else stack.steps
                step_s = _median_step(engine, b, args.prompt_len, args.steps, args.vocab)
                step_bytes = cost.weight_bytes_read_per_step(mc, b, nbytes)
                rows.append({
                    "family": family, "dtype": dtype, "path": "stack" if decode == "kernel"
                    else "eager", "batch": b, "median_step_s": step_s, "decode_tok_s": b / step_s,
                    "weight_bytes_per_step": step_bytes, "weight_bytes_per_s": step_bytes / step_s,
                    "params": cost.count_params(mc).total,
                    "stack_steps": None if stack is None else stack.steps - before,
                    "stack_refusal": engine.runner.cpu_stack_refusal if decode == "kernel"
                    else None})
                r = rows[-1]
                print(f"{family:12s} {dtype:9s} {r['path']:5s} B={b:3d} "
                      f"{r['decode_tok_s']:8.1f} tok/s  {r['weight_bytes_per_s'] / 1e9:6.2f} GB/s"
                      + (f"  (eager: {r['stack_refusal']})" if r["stack_refusal"] else ""),
                      file=sys.stderr, flush=True)
            del engine
    del hf
    return rows


def merge_rounds(rounds: list[list[dict]], families: list[str]) -> list[dict]:
    """One row per family, dtype, path and batch: the median of the rounds' median steps
    (tok/s and bytes/s from it), the rounds' tok/s in `rounds_tok_s`, in `families` order."""
    groups: dict[tuple, list[dict]] = {}
    for rows in rounds:
        for r in rows:
            groups.setdefault((r["family"], r["dtype"], r["path"], r["batch"]), []).append(r)
    merged = []
    for group in groups.values():
        first, step_s = group[0], statistics.median(r["median_step_s"] for r in group)
        merged.append(dict(first, median_step_s=step_s, decode_tok_s=first["batch"] / step_s,
                           weight_bytes_per_s=first["weight_bytes_per_step"] / step_s,
                           rounds_tok_s=[round(r["decode_tok_s"], 1) for r in group]))
    return sorted(merged, key=lambda r: families.index(r["family"]))


def add_ratios(rows: list[dict]) -> None:
    """Each row's weight bytes/s over the Llama row's of the same dtype, path and batch."""
    llama = {(r["dtype"], r["path"], r["batch"]): r["weight_bytes_per_s"] for r in rows
             if r["family"] == "llama"}
    for r in rows:
        ref = llama.get((r["dtype"], r["path"], r["batch"]))
        r["per_byte_vs_llama"] = None if not ref else r["weight_bytes_per_s"] / ref
        eager = next((e for e in rows if e["family"] == r["family"] and e["dtype"] == r["dtype"]
                      and e["batch"] == r["batch"] and e["path"] == "eager"), None)
        r["vs_eager"] = None if eager is None else r["decode_tok_s"] / eager["decode_tok_s"]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["dtype"], r["batch"]) for r in rows})
    families = list(dict.fromkeys(r["family"] for r in rows))
    fig, axes = plt.subplots(len(keys), 1, figsize=(11, 3.2 * len(keys)), squeeze=False)
    for ax, (dtype, batch) in zip(axes[:, 0], keys):
        for j, path_name in enumerate(("stack", "eager")):
            vals = [next((r["per_byte_vs_llama"] for r in rows if r["family"] == f and
                          r["dtype"] == dtype and r["batch"] == batch and r["path"] == path_name),
                         None) or 0.0 for f in families]
            ax.bar([i + 0.4 * j for i in range(len(families))], vals, 0.4, label=path_name)
        ax.axhline(0.8, color="k", ls="--", lw=0.8)
        ax.set_xticks([i + 0.2 for i in range(len(families))], families, fontsize=8)
        ax.set_ylabel("weight bytes/s\nvs Llama")
        ax.set_title(f"{dtype}, batch {batch}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=1,
                   help="every family this many times, in a rotated order each round; "
                        "each cell the median")
    p.add_argument("--tiny", action="store_true",
                   help="a dry run at a tiny shape (checks the script, measures nothing)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads = 128, 2, 4, 2
        args.intermediate, args.vocab, args.prompt_len, args.steps = 256, 512, 16, 4
        args.batches = "1,4"
    if "llama" not in args.families.split(","):
        p.error("--families must include llama (the reference)")
    if args.threads:
        torch.set_num_threads(args.threads)

    from servelm.bench.results import git_commit, machine_info
    from servelm.cpu_kernels import isa

    dtypes = [d for d in args.dtypes.split(",")
              if d != "bfloat16" or isa.usable("avx512_bf16")]
    batches = [int(b) for b in args.batches.split(",")]
    families = args.families.split(",")
    rounds = []
    for r in range(args.rounds):
        order = families[r % len(families):] + families[:r % len(families)]
        rounds.append([row for family in order
                       for row in measure(family, args, dtypes, batches)])
    rows = merge_rounds(rounds, families)
    add_ratios(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(sys.argv), "machine": machine_info(torch.get_num_threads()),
              "commit": git_commit(), "shape": {k: getattr(args, k) for k in (
                  "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab",
                  "prompt_len", "steps")}, "tiny": args.tiny, "rounds": args.rounds,
              "rows": rows}
    (out / "family-stack.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "family-stack.png")
    print(f"wrote {out / 'family-stack.json'} and family-stack.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
