"""Measure the cost of one token mask: `python -m servelm.structured.mask_cost [--model M]`.

Owns: a reproducible measurement of how long computing the allowed-token mask takes per
generated token, for llguidance (what servelm uses) and, when it is installed, xgrammar (the
alternative weighed in docs/structured_outputs.md), on the same tokenizer and outputs.
Never: runs the model; the outputs are fixed JSON texts fed token by token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string",
                                                         "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
OUTPUTS = [
    {"name": "Alice Smith", "age": 42, "tags": ["a", "bcd", "hello world"],
     "address": {"city": "Paris", "zip": "75001"}},
    {"name": "Bob", "age": 7, "tags": [], "address": {"city": "New York City", "zip": "10001"}},
]


def _summary(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"mean_us": round(statistics.fmean(times) * 1e6, 1),
            "p50_us": round(times[len(times) // 2] * 1e6, 1),
            "p99_us": round(times[int(len(times) * 0.99)] * 1e6, 1)}


def measure_llguidance(tokenizer, vocab_size, eos, token_lists, rounds):
    import llguidance
    import llguidance.torch as llt

    t0 = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                    eos_token=list(eos))
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    llguidance.LLMatcher(ll_tok, grammar)
    compile_s = time.perf_counter() - t0
    bitmask = llt.allocate_token_bitmask(1, vocab_size)
    times = []
    for _ in range(rounds):
        for ids in token_lists:
            m = llguidance.LLMatcher(ll_tok, grammar)
            for t in ids:
                start = time.perf_counter()
                llt.fill_next_token_bitmask(m, bitmask, 0)
                times.append(time.perf_counter() - start)
                assert m.consume_token(t), m.get_error()
    return {"tokenizer_setup_s": round(setup, 3), "compile_s": round(compile_s, 4),
            **_summary(times)}


def measure_xgrammar(tokenizer, vocab_size, eos, token_lists, rounds):
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                   stop_token_ids=list(eos))
    compiler = xgrammar.GrammarCompiler(info)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    times = []
    for _ in range(rounds):
        for ids in token_lists:
            m = xgrammar.GrammarMatcher(compiled)
            for t in ids:
                start = time.perf_counter()
                m.fill_next_token_bitmask(bitmask)
                times.append(time.perf_counter() - start)
                assert m.accept_token(t)
    return {"tokenizer_setup_s": round(setup, 3), "compile_s": round(compile_s, 4),
            **_summary(times)}


def measure_step_masks(tokenizer, vocab_size, eos, token_ids, batch_sizes):
    """servelm's own per-step work (GrammarMasks.masks: sync the matchers, fill every row's
    bitmask with llguidance's executor, unpack to [B, V] bool), median over the tokens."""
    from servelm.core.runner_state import RunnerSequence
    from servelm.protocol import SamplingParams, StructuredOutput
    from servelm.structured import GrammarCompiler, GrammarMasks

    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    out = {}
    for batch in batch_sizes:
        masks = GrammarMasks(compiler)
        seqs = [RunnerSequence(i, SamplingParams(structured=so), 1, None, [0])
                for i in range(batch)]
        masks.masks([(q, []) for q in seqs])  # warm up: compile, first masks
        times = []
        for t in token_ids:
            start = time.perf_counter()
            masks.masks([(q, []) for q in seqs])
            times.append(time.perf_counter() - start)
            for q in seqs:
                q.token_ids.append(t)
        med = statistics.median(times)
        out[f"batch_{batch}"] = {"step_ms": round(med * 1e3, 3),
                                 "per_sequence_us": round(med / batch * 1e6, 1)}
    return out


def main(argv=None) -> None:
    from servelm.loader import load_tokenizer, resolve_model
    from servelm.loader.model_cache import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(resolve_model(args.model))
    vocab, eos = tokenizer.vocab_size, tokenizer.eos_token_ids
    token_lists = [tokenizer.encode(json.dumps(o), add_special_tokens=False) + [eos[0]]
                   for o in OUTPUTS]
    report = {"model": args.model, "vocab_size": vocab,
              "tokens_per_round": sum(map(len, token_lists))}
    for name, fn in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        try:
            fn(tokenizer, vocab, eos, token_lists, 1)  # warm up
            report[name] = fn(tokenizer, vocab, eos, token_lists, args.rounds)
        except ImportError:
            report[name] = "not installed"
    report["servelm_step_masks"] = measure_step_masks(tokenizer, vocab, eos,
                                                      token_lists[0][:-1], (1, 8, 32))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
