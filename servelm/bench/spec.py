"""`servelm bench spec`: where speculative decoding helps, breaks even and hurts.

For each proposer (off, ngram, the target's first N layers, a quantized copy, a draft model,
an EAGLE-3 head drafting a chain or a tree) and each mode (fixed k; adaptive: the controller
may shrink k or switch off), on a copy-heavy task and on open chat, at each batch size:
end-to-end output tok/s of a greedy batch, mean accepted length (and its histogram),
acceptance per draft position, draft time share and how often the controller turned
speculation off. Greedy speculation is exact, so every method generates the same tokens and
the tok/s compare like for like. Writes JSON (command, machine, commit) and a PNG.

    servelm bench spec smollm2-135m-instruct --methods off,ngram,layers:8,quant:gguf \
        --batch-sizes 1,4,16,64 --tasks copy,chat --output-len 64 --threads 2
    servelm bench spec --methods off,ngram,quant:gguf,eagle3:HEAD,eagle3-tree:HEAD \
        --modes adaptive --tasks chat --tree-tokens 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from servelm.bench.results import git_commit, machine_info
from servelm.loader.model_cache import DEFAULT_MODEL

PROMPTS = Path(__file__).with_name("data") / "spec_prompts.json"


TREES = {"eagle3-tree": "dynamic", "eagle3-static": "static"}


def parse_method(text: str) -> dict[str, Any]:
    """off | ngram | layers:N | quant:METHOD | model:PATH | eagle3:HEAD | eagle3-tree:HEAD |
    eagle3-static:HEAD -> EngineArgs speculative fields."""
    kind, _, value = text.partition(":")
    if kind == "eagle3" and value:
        return {"speculative_method": "eagle3", "spec_draft_model": value}
    if kind in TREES and value:
        return {"speculative_method": "eagle3", "spec_draft_model": value,
                "spec_tree": TREES[kind]}
    if kind == "off" and not value:
        return {}
    if kind == "ngram" and not value:
        return {"speculative_method": "ngram"}
    if kind == "layers" and value.isdigit():
        return {"speculative_method": "draft", "spec_draft_layers": int(value)}
    if kind == "quant" and value:
        return {"speculative_method": "draft", "spec_draft_quantization": value}
    if kind == "model" and value:
        return {"speculative_method": "draft", "spec_draft_model": value}
    raise ValueError(f"--methods: unknown method {text!r} (off, ngram, layers:N, "
                     f"quant:METHOD, model:PATH, eagle3:HEAD, eagle3-tree:HEAD, "
                     f"eagle3-static:HEAD)")


def task_prompts(llm, task: str, batch: int) -> list[list[int]]:
    texts = json.loads(PROMPTS.read_text())[task]
    return [llm.encode_chat([{"role": "user", "content": texts[i % len(texts)]}])
            for i in range(batch)]


def _fresh_controller(engine, k: int, adaptive: bool) -> None:
    from servelm.engine.engine import EngineStats
    from servelm.spec import SpecController
    from servelm.spec.controller import TreeSpecController

    engine.stats = EngineStats()
    if engine.speculator is not None:
        proposer = getattr(engine.runner, "proposer", None)
        depth_for = getattr(proposer, "depth_for", None)  # a tree proposer
        ctl = (TreeSpecController(k, adaptive, depth_for=depth_for) if depth_for is not None
               else SpecController(k, adaptive))
        engine.speculator = engine.scheduler.speculator = ctl


def run_one(llm, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from servelm.protocol import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    st = engine.stats
    tokens = [o.outputs[0].token_ids for o in outs]
    n_out = sum(len(t) for t in tokens)
    ctl = engine.speculator
    row = {"num_requests": len(prompts), "num_output_tokens": n_out, "elapsed_s": elapsed,
           "output_tok_s": n_out / elapsed, "num_steps": st.num_steps,
           "spec_proposed": st.spec_num_proposed, "spec_accepted": st.spec_num_accepted,
           "acceptance_rate": st.spec_acceptance_rate,
           "mean_accepted_length": st.spec_mean_accepted_length,
           "draft_time_share": st.spec_draft_time_share,
           "acceptance_length_hist": list(st.spec_accepted_lengths),
           "position_acceptance": st.spec_position_acceptance,
           "tokens_hash": hash(tuple(map(tuple, tokens)))}
    if ctl is not None:
        row["off_steps"] = ctl.num_off_steps
        row["controller"] = ctl.snapshot()
        row["break_even_batch_estimate"] = ctl.break_even_batch()
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    from servelm.config import EngineArgs
    from servelm.llm import LLM

    names = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    base = {k: v for k, v in vars(args).items() if k in names}
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    specs = {m: parse_method(m) for m in methods}  # errors before any loading
    batches = [int(b) for b in args.batch_sizes.split(",")]
    tasks = [t.strip() for t in args.tasks.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    runs = []
    for method in methods:
        k = args.tree_tokens if "spec_tree" in specs[method] else args.num_speculative_tokens
        kw = dict(base, **specs[method], num_speculative_tokens=k)
        kw["max_num_seqs"] = max(kw.get("max_num_seqs") or 0, max(batches))
        llm = LLM(args.model, **kw)
        llm.generate([[1, 2, 3, 4]], None, use_tqdm=False)  # warm-up, off the clock
        for mode in (modes if specs[method] else ["-"]):
            for task in tasks:
                for b in batches:
                    _fresh_controller(llm.engine, k, mode == "adaptive")
                    row = run_one(llm, task_prompts(llm, task, b), args.output_len)
                    row.update(method=method, mode=mode, task=task, batch=b, k=k)
                    runs.append(row)
                    print(f"[bench spec] {method:>12} {mode:>8} {task:>4} B={b:<3} "
                          f"{row['output_tok_s']:7.1f} tok/s  accepted length "
                          f"{row['mean_accepted_length']:.2f}  off steps "
                          f"{row.get('off_steps', '-')}", file=sys.stderr, flush=True)
        del llm
    _check_same_tokens(runs)
    return {"command": ["servelm", "bench", "spec"] + sys.argv[3:] if sys.argv[1:2] == ["bench"]
            else sys.argv, "machine": machine_info(args.num_threads), "commit": git_commit(),
            "model": args.model, "output_len": args.output_len,
            "num_speculative_tokens": args.num_speculative_tokens, "runs": runs}


def _check_same_tokens(runs: list[dict[str, Any]]) -> None:
    """Greedy speculation is exact: flag (not hide) any run whose tokens differ from 'off'
    (a float near-tie can flip one token between batch shapes)."""
    ref = {(r["task"], r["batch"]): r["tokens_hash"] for r in runs if r["method"] == "off"}
    for r in runs:
        key = (r["task"], r["batch"])
        r["same_tokens_as_off"] = ref.get(key) == r["tokens_hash"] if key in ref else None
        del r["tokens_hash"]


def summary(result: dict[str, Any]) -> str:
    runs = result["runs"]
    off = {(r["task"], r["batch"]): r["output_tok_s"] for r in runs if r["method"] == "off"}
    lines = ["method        mode      task  batch  tok/s   speedup  acc.len  accept  draft%  off"]
    for r in runs:
        base = off.get((r["task"], r["batch"]))
        speed = f"{r['output_tok_s'] / base:6.2f}x" if base else "     -"
        lines.append(f"{r['method']:<13} {r['mode']:<9} {r['task']:<5} {r['batch']:>5}  "
                     f"{r['output_tok_s']:6.1f}  {speed}  {r['mean_accepted_length']:7.2f}  "
                     f"{r['acceptance_rate']:6.2f}  {100 * r['draft_time_share']:5.1f}  "
                     f"{r.get('off_steps', '-')}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = result["runs"]
    tasks = sorted({r["task"] for r in runs})
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    off = {(r["task"], r["batch"]): r["output_tok_s"] for r in runs if r["method"] == "off"}
    for ax, task in zip(axes[0], tasks):
        series: dict[str, list] = {}
        for r in runs:
            if r["task"] == task and r["method"] != "off" and (task, r["batch"]) in off:
                series.setdefault(f"{r['method']} ({r['mode']})", []).append(
                    (r["batch"], r["output_tok_s"] / off[(task, r["batch"])]))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([b for b, _ in pts], [s for _, s in pts], marker="o",
                    linestyle="--" if "fixed" in label else "-", label=label)
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (concurrent sequences)")
        ax.set_ylabel("output tok/s vs no speculation")
        ax.set_title(f"{task} task")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"speculative decoding, {result['model']}, k={result['num_speculative_tokens']}"
                 f", {result['output_len']} new tokens, {result['machine']['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_spec(args: argparse.Namespace) -> int:
    try:
        for m in args.methods.split(","):
            parse_method(m.strip())
    except ValueError as e:
        print(f"servelm bench spec: error: {e}", file=sys.stderr)
        return 2
    result = run(args)
    out = Path(args.out) if args.out else Path("benchmarks/results") / (
        "spec-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result, out.with_suffix(".png"))
    print(summary(result))
    print(f"[bench spec] wrote {out}" + (f" and {png}" if png else ""), file=sys.stderr)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("spec", help="speculative decoding: tok/s and acceptance by "
                              "proposer, task and batch size; JSON and PNG",
                              description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--methods", default="off,ngram,layers:8",
                   help="comma-separated: off, ngram, layers:N, quant:METHOD, model:PATH, "
                        "eagle3:HEAD (chain), eagle3-tree:HEAD (dynamic tree), "
                        "eagle3-static:HEAD (static tree)")
    p.add_argument("--tree-tokens", type=int, default=8,
                   help="tree methods: most nodes per tree (k for the others: "
                        "--num-speculative-tokens)")
    p.add_argument("--modes", default="fixed,adaptive",
                   help="fixed: always k drafts; adaptive: the controller decides")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--tasks", default="copy,chat", help="copy (rewrite with small edits), "
                   "chat (open questions)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=None)
    from servelm.config import add_engine_cli_args

    add_engine_cli_args(p)
    p.set_defaults(func=cmd_spec)
    return p
