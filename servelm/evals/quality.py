"""One quality record per quantization method: bytes per parameter, KV bytes per token,
perplexity on the held-out text, and (against `servelm serve`) greedy agreement with the
unquantized model, exact match and the lm-eval task. `servelm eval quality` writes it.

The first method is the reference (normally "float32": no quantization): deltas and
agreement are measured against it.
"""

from __future__ import annotations

import gc
import hashlib
import time
from pathlib import Path
from typing import Any

from servelm.evals import HELDOUT_TEXT

FLOAT = "float32"  # the method name of "no quantization" in records and on the command line


def weight_bytes(model) -> tuple[int, int]:
    """(weights, bytes) of every matmul layer, lm_head included; the embedding lookup is not
    a matmul and is left out. Quantized layers count codes plus scales (num_weight_bytes)."""
    num_weights = num_bytes = 0
    for module in model.modules():
        if not (hasattr(module, "in_features") and hasattr(module, "out_features")):
            continue
        if any(hasattr(child, "in_features") for child in module.children()):
            continue
        n = module.in_features * module.out_features
        if hasattr(module, "num_weight_bytes"):
            b = module.num_weight_bytes
        else:
            w = getattr(module, "weight", None)
            if w is None:
                w = module.packed_weight
            b = n * w.element_size()
        num_weights, num_bytes = num_weights + n, num_bytes + b
    if getattr(model, "lm_head", "absent") is None:  # tied, float: the embedding is the head
        w = model.embed_tokens.weight
        num_weights, num_bytes = num_weights + w.numel(), num_bytes + w.numel() * w.element_size()
    return num_weights, num_bytes


def _engine_stats(model: str, method: str, text: str, window: int, engine_kwargs: dict
                  ) -> dict[str, Any]:
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine
    from servelm.evals.perplexity import perplexity

    from servelm.quant.int8_act import split_method

    method, dtype = split_dtype(method)  # "gguf@bfloat16": that method in bfloat16
    if dtype is not None:
        engine_kwargs = {**engine_kwargs, "dtype": dtype}
    quant, acts = split_method(method)  # "gguf+a8": int8 activations
    engine = build_engine(EngineArgs(model=model, quantization=None if method == FLOAT else quant,
                                     quant_activations=acts, **engine_kwargs))
    num_weights, num_bytes = weight_bytes(engine.runner.model)
    cfg = engine.model_config
    start = time.monotonic()
    ppl = perplexity(engine, text, window)
    stats = {
        "matmul_weights": num_weights, "matmul_weight_bytes": num_bytes,
        "bytes_per_param": num_bytes / num_weights,
        "kv_bytes_per_token": {"float32": cfg.kv_bytes_per_token(4),
                               "bfloat16": cfg.kv_bytes_per_token(2)},
        "perplexity": ppl.perplexity, "nll": ppl.nll, "ppl_tokens": ppl.num_tokens,
        "ppl_windows": ppl.num_windows, "ppl_seconds": time.monotonic() - start,
    }
    del engine
    gc.collect()
    return stats


def run_quality(model: str, methods: list[str], text_path: Path = HELDOUT_TEXT,
                window: int = 1024, serve_args: list[str] | None = None,
                run_lm_eval: bool = True, lm_eval_limit: int | None = None,
                log=print, dtype: str | None = None) -> dict[str, Any]:
    """dtype: every engine's --dtype (None: the engine's default)."""
    from servelm.evals import behaviour
    from servelm.evals.serve_process import ServeProcess

    text = Path(text_path).read_text(encoding="utf-8")
    engine_kwargs = {"kv_cache_memory": 256 * 2**20, "max_model_len": max(window, 2048)}
    serve_args = serve_args or ["--kv-cache-memory", "256MiB", "--max-model-len", "2048"]
    if dtype is not None:
        engine_kwargs["dtype"] = dtype
        serve_args = [*serve_args, "--dtype", dtype]
    prompts = behaviour.load_agreement_prompts()
    rows: dict[str, dict[str, Any]] = {}
    reference_tokens = None
    for method in methods:
        start = time.monotonic()
        row = _engine_stats(model, method, text, window, engine_kwargs)
        log(f"[{method}] perplexity {row['perplexity']:.3f} ({row['ppl_tokens']} tokens), "
            f"{row['bytes_per_param']:.3f} bytes/param")
        base, method_dtype = split_dtype(method)
        quant = [] if base == FLOAT else _serve_quant_args(base)
        extra = [] if method_dtype is None else ["--dtype", method_dtype]  # the later wins
        with ServeProcess(model, quant + serve_args + extra) as server:
            tokens = behaviour.greedy_chat_tokens(server.url, server.served_model_name,
                                                  prompts)
            if reference_tokens is None:
                reference_tokens = tokens
            agree = behaviour.agreement(reference_tokens, tokens)
            em = behaviour.exact_match(server.url, server.served_model_name)
            row["agreement"] = {"num_agree": agree.num_agree, "num_prompts": agree.num_prompts,
                                "share": agree.share,
                                "first_divergence": agree.first_divergence,
                                "max_tokens": behaviour.AGREEMENT_TOKENS}
            row["exact_match"] = {"num_correct": em.num_correct, "num_items": em.num_items,
                                  "score": em.score, "answers": em.answers}
            log(f"[{method}] agreement {agree.num_agree}/{agree.num_prompts}, exact match "
                f"{em.num_correct}/{em.num_items}")
            if run_lm_eval:
                from servelm.evals.lm_eval_task import run_lm_eval as lm_eval_run

                r = lm_eval_run(server.url, server.served_model_name, limit=lm_eval_limit)
                row["lm_eval"] = r._asdict()
                log(f"[{method}] lm-eval {r.task} exact_match {r.score:.3f} "
                    f"(n={r.num_samples})")
        row["seconds"] = time.monotonic() - start
        rows[method] = row
    _add_deltas(rows, methods[0])
    return {"kind": "quality", "model": model, "reference_method": methods[0], "dtype": dtype,
            "text": {"path": str(text_path), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                     "window": window},
            "methods": rows}


def split_dtype(method: str) -> tuple[str, str | None]:
    """"gguf@bfloat16" -> ("gguf", "bfloat16"): a method run in another --dtype than the
    record's (bfloat16 against the float32 reference); no suffix -> (method, None)."""
    base, sep, dtype = method.partition("@")
    if sep and dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"methods: {method!r}: the dtype after '@' must be float32, "
                         "bfloat16 or float16")
    return base, (dtype if sep else None)


def _serve_quant_args(method: str) -> list[str]:
    from servelm.quant.int8_act import split_method

    quant, acts = split_method(method)
    return ["--quantization", quant, "--quant-activations", acts]


def _add_deltas(rows: dict[str, dict[str, Any]], reference: str) -> None:
    ref = rows[reference]
    for row in rows.values():
        row["ppl_delta"] = row["perplexity"] / ref["perplexity"] - 1
        row["exact_match_delta"] = row["exact_match"]["score"] - ref["exact_match"]["score"]
        if "lm_eval" in row and "lm_eval" in ref:
            row["lm_eval_delta"] = row["lm_eval"]["score"] - ref["lm_eval"]["score"]


def render_table(record: dict[str, Any]) -> str:
    """The docs/quantization.md table (markdown) from a record."""
    lines = ["| method | bytes/param (matmuls) | KV bytes/token fp32 / bf16 | perplexity | "
             "ppl delta | agreement | exact match | lm-eval arith | decode tok/s b=1 / b=64 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, r in record["methods"].items():
        kv = r["kv_bytes_per_token"]
        a, em = r["agreement"], r["exact_match"]
        lm = (f"{r['lm_eval']['score']:.2f} ({r.get('lm_eval_delta', 0):+.2f})"
              if "lm_eval" in r else "-")
        lines.append(
            f"| {method} | {r['bytes_per_param']:.3f} | {kv['float32']} / {kv['bfloat16']} | "
            f"{r['perplexity']:.3f} | {100 * r['ppl_delta']:+.2f}% | "
            f"{a['num_agree']}/{a['num_prompts']} | {em['num_correct']}/{em['num_items']} "
            f"({r['exact_match_delta']:+.2f}) | {lm} | (lead, quiet machine) |")
    return "\n".join(lines)
