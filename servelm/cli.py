"""The `servelm` command: generate, chat, serve, models, bench, plan, kernels.

Each sub-package registers its own sub-command (`add_parser(subparsers)`); this file wires
them and holds the two that drive the engine directly: `generate` and `chat`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from servelm.config import add_engine_cli_args, engine_args_from_cli
from servelm.loader.model_cache import DEFAULT_MODEL
from servelm.own_env import apply_defaults
from servelm.protocol import InvalidParameterError, SamplingParams

# Sub-packages that register their own sub-commands.
# The command each module registers: `servelm CMD ...` imports only CMD's module (building
# every parser imports FastAPI, numpy and the planner: a second of every `servelm serve`
# start); help and an unknown command build them all.
_SUBCOMMANDS = {"models": "servelm.loader.cli", "bench": "servelm.bench.cli",
                "plan": "servelm.planner.cli", "serve": "servelm.serve.cli",
                "config": "servelm.serve.config_file",
                "quantize": "servelm.quant_tools.cli", "eval": "servelm.evals.cli",
                "sim": "servelm.sim.cli", "router": "servelm.router.cli",
                "doctor": "servelm.doctor.cli", "kernels": "servelm.cpu_kernels.cli",
                "spec": "servelm.spec_tools.cli"}
_SUBCOMMAND_MODULES = list(_SUBCOMMANDS.values())


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.sampling_seed,
                          stop=args.stop)


def _build_llm(args):
    from servelm.llm import LLM

    start = time.monotonic()
    llm = LLM(engine=_engine(args))
    print(f"[servelm] loaded {args.model} in {time.monotonic() - start:.1f}s", file=sys.stderr)
    return llm


def _engine(args):
    from servelm.engine_builder import build_engine

    return build_engine(engine_args_from_cli(args))


def cmd_generate(args) -> int:
    params = _sampling_params(args)
    llm = _build_llm(args)
    start = time.monotonic()
    out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    elapsed = time.monotonic() - start
    print(out.outputs[0].text)
    n = len(out.outputs[0].token_ids)
    t = out.timings
    print(f"[servelm] {len(out.prompt_token_ids)} prompt + {n} new tokens in {elapsed:.2f}s; "
          f"TTFT {t.ttft_s * 1000:.0f} ms; finish: {out.outputs[0].finish_reason.value}",
          file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    params = _sampling_params(args)
    llm = _build_llm(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chat with the model. Empty line or Ctrl-D to quit; /reset to start over.",
          file=sys.stderr)
    while True:
        try:
            user = input("you> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not user:
            return 0
        if user == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": user})
        reply = _stream_reply(llm, messages, params)
        messages.append({"role": "assistant", "content": reply})


def _stream_reply(llm, messages: list[dict], params: SamplingParams) -> str:
    """Print the answer token by token as the engine produces it."""
    from servelm.protocol import EngineRequest

    ids = llm.encode_chat(messages)
    rid = f"chat-{time.monotonic_ns()}"
    llm.engine.add_request(EngineRequest(rid, ids, params))
    print("assistant> ", end="", flush=True)
    text = ""
    while llm.engine.has_unfinished:
        for delta in llm.engine.step():
            text += delta.text
            print(delta.text, end="", flush=True)
    print()
    return text


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line parser; with `argv` naming a command, only that command's."""
    parser = argparse.ArgumentParser(prog="servelm", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt; prints only the completion")
    gen.add_argument("model", help="cached model name, .gguf file, HF directory or Hugging Face "
                     "name ORG/NAME[:TAG][@REVISION]")
    gen.add_argument("--prompt", required=True)
    _sampling_args(gen, max_tokens=128)
    add_engine_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    chat.add_argument("--system", default=None, help="system prompt")
    _sampling_args(chat, max_tokens=512)
    add_engine_cli_args(chat)
    chat.set_defaults(func=cmd_chat)

    command = next((a for a in (argv or []) if not a.startswith("-")), None)
    modules = [_SUBCOMMANDS[command]] if command in _SUBCOMMANDS else _SUBCOMMAND_MODULES
    if command in ("generate", "chat"):
        modules = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.add_parser(sub)
    return parser


# Sub-commands that run an engine: the environment defaults (servelm/own_env.py) are theirs.
_ENGINE_COMMANDS = {"serve", "bench", "generate", "chat", "eval", "spec"}


def main(argv: list[str] | None = None) -> int:
    argv_ = sys.argv[1:] if argv is None else argv
    if next((a for a in argv_ if not a.startswith("-")), None) in _ENGINE_COMMANDS:
        apply_defaults()  # before the sub-command loads torch (libgomp reads them then)
    args = build_parser(argv_).parse_args(argv)
    if args.command in ("serve", "config"):  # --config FILE under the flags given here
        from servelm.serve.config_file import with_config_file

        args = with_config_file(args, argv_)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="[servelm] %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except InvalidParameterError as e:
        print(f"servelm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
