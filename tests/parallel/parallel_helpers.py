"""Tiny checkpoints on disk and request runs for the model-parallel tests (import as
`parallel_helpers`): a worker process reads its shard from a directory, so the models are
saved (safetensors + a word-level tokenizer) rather than handed over in memory."""

from __future__ import annotations

from pathlib import Path

PROMPTS = [[5, 17, 99, 3, 250, 11, 42], [7, 8, 9], list(range(20, 50))]


def save_tiny(family: str, root: Path, **overrides) -> str:
    """A tiny random-weight `family` checkpoint under root (once per name), its path."""
    import tokenizers
    from tiny_families import FAMILIES, make_tiny_family_model
    from tiny_models import TINY_ARCHS, make_tiny_hf_model

    name = family + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    path = root / name
    if not path.exists():
        make = make_tiny_hf_model if family in TINY_ARCHS else make_tiny_family_model
        assert family in TINY_ARCHS or family in FAMILIES
        make(family, **overrides).save_pretrained(path)
        vocab = {f"t{i}": i for i in range(384)}
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        tok.save(str(path / "tokenizer.json"))
    return str(path)


def run_greedy(engine, prompts=PROMPTS, max_tokens: int = 8):
    """Every prompt at once, greedy: ({request: tokens}, {request: [logprob, ...]}) with the
    top-5 logprobs of every prompt and output position (they are log_softmax of the logits:
    the logits up to one constant per row)."""
    from servelm.protocol import EngineRequest, SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", list(p), SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5,
            prompt_logprobs=5)))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    lps = {k: [] for k in tokens}
    while engine.has_unfinished:
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
            for lp in [*(d.prompt_logprobs or []), *(d.logprobs or [])]:
                if lp is not None:
                    lps[d.request_id] += [lp.logprob, *(v for _, v in lp.top)]
    return tokens, lps


def max_logprob_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and all(len(a[k]) == len(b[k]) > 0 for k in a)
    return max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))


def build(path: str, **kwargs):
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine

    kwargs.setdefault("num_blocks", 64)
    # float32 whatever --dtype auto picks: the comparisons are TP against TP=1 within float32
    # rounding (in bfloat16 each rank rounds its partial sum before the all-reduce adds them)
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("block_size", 4)
    return build_engine(EngineArgs(model=path, **kwargs))
