"""`servelm spec train`: an EAGLE-3 head for the served model, trained here
(servelm/spec/train_eagle.py).

Owns the command's flags and building the target's engine and LLM, which the trainer is
handed (it sits in spec/, below the assembly). Never: the training itself."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from servelm.config import add_engine_cli_args
    from servelm.loader.model_cache import DEFAULT_MODEL

    spec = sub.add_parser("spec", help="speculative decoding tools")
    inner = spec.add_subparsers(dest="spec_command", required=True)
    t = inner.add_parser("train", help="train an EAGLE-3 head for the model by "
                                       "self-distillation (CPU, resumable)")
    t.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="the target model")
    t.add_argument("--out", required=True, help="output directory: the head (EAGLE-3 "
                   "layout, for --speculative-model) and the resumable state")
    t.add_argument("--prompts", default=None, help="JSONL of {'prompt'|'messages'|"
                   "'token_ids'} (default: the set shipped in servelm/spec/data)")
    t.add_argument("--num-prompts", type=int, default=None)
    t.add_argument("--max-new-tokens", type=int, default=256)
    t.add_argument("--train-steps", type=int, default=2000)
    t.add_argument("--ttt-steps", type=int, default=3,
                   help="training-time-test steps (the drafter fed its own outputs)")
    t.add_argument("--draft-vocab-size", type=int, default=8192)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--save-every", type=int, default=100)
    add_engine_cli_args(t)
    t.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from servelm.config import engine_args_from_cli
    from servelm.engine_builder import build_engine
    from servelm.llm import LLM
    from servelm.spec.train_eagle import DEFAULT_PROMPTS, TrainOptions, train

    opts = TrainOptions(out=args.out, prompts=args.prompts or DEFAULT_PROMPTS,
                        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                        steps=args.train_steps, ttt_steps=args.ttt_steps,
                        draft_vocab_size=args.draft_vocab_size, lr=args.lr,
                        save_every=args.save_every)
    engine = build_engine(engine_args_from_cli(args))
    train(LLM(engine=engine), opts)
    print(f"EAGLE-3 head written to {args.out}: serve with --speculative-method eagle3 "
          f"--speculative-model {args.out}")
    return 0
