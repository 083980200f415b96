"""Where int8 activations' accuracy cost comes from: the decoder layers' linears or the head.

The default GGUF served with `--quantization gguf` twice (float32 dtype), with float and with
int8 activations; the two engines' lm_heads (the same int8 Q8_0 codes, one computing with
float32 activations, one with int8) are then swapped between them, which gives all four
combinations without a new option. For each: perplexity on the held-out text
(servelm/evals/data/heldout_en.txt, windows of 1,024 tokens, as `servelm eval perplexity`) and
next-token agreement with float activations everywhere (teacher-forced: at every position of
the text, the same argmax). Quality numbers, not timing: any load is fine. Writes result.json
(command, machine, commit) under benchmarks/results/quant-act-head-<UTC ts>/.

    .venv/bin/python benchmarks/cpu/quant_act_head.py [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from servelm.bench.results import git_commit, machine_info
from servelm.config import EngineArgs
from servelm.engine_builder import build_engine
from servelm.evals import HELDOUT_TEXT
from servelm.evals.perplexity import score_tokens


def _scores(engine, ids: list[int], window: int):
    """(nll sum, argmax per predicted position) over consecutive windows."""
    nll, tops = 0.0, []
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            continue
        logits = score_tokens(engine, chunk)[:-1].float()
        target = torch.tensor(chunk[1:])[:, None]
        nll -= torch.log_softmax(logits, -1).gather(1, target).sum().item()
        tops.append(logits.argmax(-1))
    return nll, torch.cat(tops)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    kw = dict(model=args.model, quantization="gguf", dtype="float32",
              kv_cache_memory=256 * 2**20, max_model_len=max(2048, args.window))
    engines = {a: build_engine(EngineArgs(quant_activations=a, **kw)) for a in ("float", "int8")}
    if engines["int8"].runner.model.lm_head.activations != "int8":
        sys.exit("int8 activations did not take (this CPU does not run avx512_vnni)")
    heads = {a: e.runner.model.lm_head for a, e in engines.items()}
    ids = engines["float"].tokenizer.encode(Path(HELDOUT_TEXT).read_text(encoding="utf-8"))
    rows, ref_tops = [], None
    for blocks, head in (("float", "float"), ("int8", "int8"), ("int8", "float"),
                         ("float", "int8")):
        engine = engines[blocks]
        engine.runner.model.lm_head = heads[head]
        nll, tops = _scores(engine, ids, args.window)
        engine.runner.model.lm_head = heads[blocks]
        ref_tops = tops if ref_tops is None else ref_tops
        row = {"blocks": blocks, "head": head, "perplexity": round(math.exp(nll / len(tops)), 4),
               "next_token_agreement": round((tops == ref_tops).float().mean().item(), 5),
               "predicted_tokens": len(tops)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out_dir or f"benchmarks/results/quant-act-head-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "quant-act-head", "command": " ".join([sys.executable] + sys.argv),
              "machine": machine_info(), "commit": git_commit(), "created": stamp,
              "model": args.model, "text": str(HELDOUT_TEXT), "window": args.window,
              "rows": rows}
    (out / "result.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
