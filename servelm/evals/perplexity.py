"""Perplexity of an engine's model on a text, from `ModelRunner.score` (logits at every
position), over consecutive windows of at most `window` tokens.

Each window starts without context (the first token of a window is not predicted), so the
number is comparable between methods and engines at the same window, not across windows.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class PerplexityResult(NamedTuple):
    perplexity: float
    nll: float  # mean negative log-likelihood, nats per predicted token
    num_tokens: int  # predicted tokens
    num_windows: int


def score_tokens(engine, token_ids: list[int]):
    """Logits [len, vocab] (float32) of the engine's model at every position of one sequence.
    Uses and frees KV blocks like a request would; the engine must be idle."""
    from servelm.core.runner_state import score_item
    from servelm.engine.sequence import Sequence
    from servelm.protocol import RequestTimings, SamplingParams

    seq = Sequence("score", 0, list(token_ids), SamplingParams(max_tokens=1), RequestTimings(),
                   1)
    if not engine.block_manager.can_allocate(seq, len(token_ids)):
        raise ValueError(f"not enough free KV blocks to score {len(token_ids)} tokens")
    engine.block_manager.allocate(seq, len(token_ids))
    try:
        return engine.runner.score([score_item(seq.token_ids, seq.block_table, 0,
                                               len(token_ids))])
    finally:
        engine.block_manager.free(seq)


def perplexity(engine, text: str, window: int = 1024) -> PerplexityResult:
    """Perplexity of `text` as the engine's tokenizer encodes it."""
    if engine.tokenizer is None:
        raise ValueError("perplexity of a text needs a model with a tokenizer")
    return perplexity_of_ids(engine, engine.tokenizer.encode(text), window)


def perplexity_of_ids(engine, ids: list[int], window: int = 1024) -> PerplexityResult:
    import torch

    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if window > engine.max_model_len:
        raise ValueError(f"window {window} exceeds the engine's max_model_len "
                         f"{engine.max_model_len}")
    total, count, windows = 0.0, 0, 0
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            continue
        logits = score_tokens(engine, chunk)
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        target = torch.tensor(chunk[1:], device=logprobs.device)[:, None]
        total -= logprobs.gather(1, target).sum().item()
        count, windows = count + len(chunk) - 1, windows + 1
    if count == 0:
        raise ValueError("text is too short: it has fewer than 2 tokens")
    return PerplexityResult(math.exp(total / count), total / count, count, windows)
