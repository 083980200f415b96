"""`servelm eval {perplexity, behaviour, lm-eval, quality}`: the quality evals from the
command line (docs/quantization.md "Quality").

Never: imports torch, httpx or lm-eval before a command runs.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path


def add_parser(subparsers) -> None:
    from servelm.config import add_engine_cli_args
    from servelm.evals import HELDOUT_TEXT

    p = subparsers.add_parser("eval", help="quality evals: perplexity, behaviour, lm-eval")
    sub = p.add_subparsers(dest="eval_command", required=True)

    ppl = sub.add_parser("perplexity", help="perplexity of MODEL on a text (in process)")
    ppl.add_argument("model")
    ppl.add_argument("--text", type=Path, default=HELDOUT_TEXT,
                     help="UTF-8 text file (default: the shipped held-out English text)")
    ppl.add_argument("--window", type=int, default=1024,
                     help="tokens per independently scored window")
    add_engine_cli_args(ppl)
    ppl.set_defaults(func=cmd_perplexity)

    beh = sub.add_parser("behaviour", help="exact match (and greedy agreement with "
                                           "--reference-url) against running servers")
    beh.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    beh.add_argument("--reference-url", default=None,
                     help="server of the unquantized model, for greedy agreement")
    beh.add_argument("--model", default="model", help="the `model` field of requests")
    beh.add_argument("--api-key", default=None)
    beh.set_defaults(func=cmd_behaviour)

    lm = sub.add_parser("lm-eval", help="lm-eval's local-completions on the local "
                                        "servelm_arith task against a running server")
    lm.add_argument("--base-url", required=True)
    lm.add_argument("--model", default="model")
    lm.add_argument("--limit", type=int, default=None, help="first N questions only")
    lm.set_defaults(func=cmd_lm_eval)

    q = sub.add_parser("quality", help="every eval per method; one JSON record")
    q.add_argument("model")
    q.add_argument("--methods", default="float32,int8,int4-g32,int4-g128,gguf",
                   help="comma-separated; the first is the reference (float32 = none); a "
                        "'+a8' suffix (gguf+a8) runs the method with --quant-activations int8, an "
                        "'@DTYPE' suffix (float32@bfloat16) in that --dtype")
    q.add_argument("--out", type=Path, default=None, help="JSON record path")
    q.add_argument("--window", type=int, default=1024)
    q.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                   help="every engine's --dtype (default: the engine's default)")
    q.add_argument("--no-lm-eval", dest="lm_eval", action="store_false")
    q.add_argument("--lm-eval-limit", type=int, default=None)
    q.set_defaults(func=cmd_quality)


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2))


def cmd_perplexity(args) -> int:
    from servelm.config import engine_args_from_cli
    from servelm.engine_builder import build_engine
    from servelm.evals.perplexity import perplexity

    engine = build_engine(engine_args_from_cli(args))
    r = perplexity(engine, args.text.read_text(encoding="utf-8"), args.window)
    _print_json({"model": args.model, "quantization": args.quantization,
                 "text": str(args.text), **r._asdict()})
    return 0


def cmd_behaviour(args) -> int:
    from servelm.evals import behaviour

    out = {}
    if args.reference_url:
        prompts = behaviour.load_agreement_prompts()
        ref = behaviour.greedy_chat_tokens(args.reference_url, args.model, prompts,
                                           api_key=args.api_key)
        cand = behaviour.greedy_chat_tokens(args.base_url, args.model, prompts,
                                            api_key=args.api_key)
        out["agreement"] = behaviour.agreement(ref, cand)._asdict()
    out["exact_match"] = behaviour.exact_match(args.base_url, args.model,
                                               api_key=args.api_key)._asdict()
    _print_json(out)
    return 0


def cmd_lm_eval(args) -> int:
    from servelm.evals.lm_eval_task import run_lm_eval

    _print_json(run_lm_eval(args.base_url, args.model, limit=args.limit)._asdict())
    return 0


def cmd_quality(args) -> int:
    from servelm.bench.results import git_commit, machine_info
    from servelm.evals.quality import render_table, run_quality

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    from servelm.quant import quant_method_names

    from servelm.quant.int8_act import split_method  # "gguf+a8": gguf, int8 activations

    from servelm.evals.quality import split_dtype  # "gguf@bfloat16": gguf in bfloat16
    from servelm.protocol import InvalidParameterError

    try:
        bases = [split_dtype(m)[0] for m in methods]
    except ValueError as exc:
        raise InvalidParameterError(str(exc), param="methods") from None
    bad = [m for m, b in zip(methods, bases)
           if b != "float32" and split_method(b)[0] not in quant_method_names()]
    if bad or not methods:
        raise InvalidParameterError(f"methods {bad or methods!r}: each must be 'float32' or "
                                    f"one of {quant_method_names()} (+a8: int8 "
                                    "activations, @DTYPE: in that dtype)", param="methods")
    machine, commit = machine_info(), git_commit()
    record = run_quality(args.model, methods, window=args.window, run_lm_eval=args.lm_eval,
                         lm_eval_limit=args.lm_eval_limit, dtype=args.dtype,
                         log=lambda s: print(s, file=sys.stderr, flush=True))
    record.update({"command": "servelm " + shlex.join(sys.argv[1:]), "machine": machine,
                   "commit": commit,
                   "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"[servelm] wrote {args.out}", file=sys.stderr)
    print(render_table(record))
    return 0
