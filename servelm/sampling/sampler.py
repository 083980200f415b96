"""sample(logits, SamplingTensors) -> SamplerOutput. A pure function of its inputs.

Order (as vLLM and HF apply them): banned tokens (min_tokens, bad words) -> allowed-token
masks (structured outputs, allowed_token_ids) -> logit_bias -> penalties -> greedy argmax, or
temperature -> top-k -> top-p -> min-p -> draw. Logprobs are of the model's raw distribution.
A draw uses the exponential race (argmax p / E, E ~ Exp(1)), so a seeded row's draw depends
only on its own generator: the same seed gives the same output whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [B] float; rows with 0 are greedy
    top_ks: torch.Tensor | None = None  # [B] long; vocab size where disabled
    top_ps: torch.Tensor | None = None  # [B] float
    min_ps: torch.Tensor | None = None  # [B] float
    repetition_penalties: torch.Tensor | None = None  # [B]
    presence_penalties: torch.Tensor | None = None  # [B]
    frequency_penalties: torch.Tensor | None = None  # [B]
    prompt_tokens: torch.Tensor | None = None  # [B, Lp] padded with vocab_size
    output_tokens: torch.Tensor | None = None  # [B, Lo] padded with vocab_size
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, token ids)
    allowed: torch.Tensor | None = None  # [B, V] bool; False: the token cannot be drawn
    biases: list[tuple[int, list[int], list[float]]] = field(default_factory=list)  # logit_bias
    generators: list[torch.Generator | None] = field(default_factory=list)  # per row
    num_logprobs: int | None = None  # top-k alternatives to return (max over rows)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperatures == 0).all())


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor | None = None  # [B] logprob of each sampled token
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]


def draw_tensors(params: list, vocab_size: int, device) -> SamplingTensors:
    """Temperature (0 for greedy rows), top-k, top-p and min-p of each row's SamplingParams;
    the rest (penalties, bans, generators, logprobs) is the caller's."""

    def col(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    st = SamplingTensors(temperatures=col([0.0 if p.is_greedy else p.temperature
                                           for p in params]))
    if st.all_greedy:
        return st
    if any(p.top_k > 0 for p in params):
        st.top_ks = col([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.long)
    if any(p.top_p < 1.0 for p in params):
        st.top_ps = col([p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        st.min_ps = col([p.min_p for p in params])
    return st


def sample(logits: torch.Tensor, st: SamplingTensors,
           argmax: torch.Tensor | None = None) -> SamplerOutput:
    """logits: [B, V] float32. argmax: each row's argmax of these logits where the caller
    has it (the runner's logit pass computes it); used only if no mask, bias or penalty
    changed the logits."""
    given = logits
    raw_logprobs = None
    if st.num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = _ban(logits, st.banned)
    if st.allowed is not None:
        logits = logits.masked_fill(~st.allowed, float("-inf"))
    logits = _add_biases(logits, st.biases)
    logits = _apply_penalties(logits, st)
    greedy = argmax if argmax is not None and logits is given else logits.argmax(dim=-1)
    if st.all_greedy:
        tokens = greedy
    else:
        tokens = torch.where(st.temperatures == 0, greedy, _draw(logits, st))
    out = SamplerOutput(tokens)
    if raw_logprobs is not None:
        out.logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
        if st.num_logprobs > 0:
            out.top_logprobs, out.top_ids = raw_logprobs.topk(st.num_logprobs, dim=-1)
    return out


def _ban(logits: torch.Tensor, banned: list[tuple[int, list[int]]]) -> torch.Tensor:
    if not banned:
        return logits
    logits = logits.clone()
    for row, ids in banned:
        logits[row, ids] = float("-inf")
    return logits


def _add_biases(logits: torch.Tensor, biases: list) -> torch.Tensor:
    if not biases:
        return logits
    logits = logits.clone()  # the caller's logits stay as they were
    for row, ids, values in biases:
        logits[row, ids] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits


def _token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """tokens: [B, L] padded with vocab_size -> counts [B, V]."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.float32,
                         device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
    return counts[:, :vocab_size]


def _apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    vocab = logits.shape[1]
    has_output = st.output_tokens is not None
    if st.repetition_penalties is not None:
        # HF semantics: every token seen in prompt or output is divided (if positive) or
        # multiplied (if negative) by the penalty.
        seen = _token_counts(st.output_tokens, vocab) > 0 if has_output else None
        if st.prompt_tokens is not None:
            prompt_seen = _token_counts(st.prompt_tokens, vocab) > 0
            seen = prompt_seen if seen is None else seen | prompt_seen
        if seen is not None:
            p = st.repetition_penalties[:, None]
            penalised = torch.where(logits > 0, logits / p, logits * p)
            logits = torch.where(seen, penalised, logits)
    if has_output and (st.presence_penalties is not None or st.frequency_penalties is not None):
        # OpenAI semantics: over generated tokens only.
        counts = _token_counts(st.output_tokens, vocab)
        if st.frequency_penalties is not None:
            logits = logits - st.frequency_penalties[:, None] * counts
        if st.presence_penalties is not None:
            logits = logits - st.presence_penalties[:, None] * (counts > 0).float()
    return logits


def sampling_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution a draw samples from: temperature -> top-k -> top-p -> softmax ->
    min-p ([B, V]; min-p rows are not renormalised, a draw does not need it). Speculative
    verification compares these for target and draft."""
    temps = torch.where(st.temperatures == 0, torch.ones_like(st.temperatures), st.temperatures)
    logits = logits / temps[:, None]
    if st.top_ks is not None:
        logits = _top_k(logits, st.top_ks)
    if st.top_ps is not None:
        logits = _top_p(logits, st.top_ps)
    probs = torch.softmax(logits, dim=-1)
    if st.min_ps is not None:
        keep = probs >= st.min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs


def _draw(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    probs = sampling_probs(logits, st)
    noise = torch.empty_like(probs)
    shared_rows = []
    for row, gen in enumerate(st.generators or [None] * probs.shape[0]):
        if gen is None:
            shared_rows.append(row)
        else:
            noise[row].exponential_(generator=gen)
    if shared_rows:
        if len(shared_rows) == probs.shape[0]:
            noise.exponential_()
        else:
            idx = torch.tensor(shared_rows, device=probs.device)
            noise[idx] = torch.empty(len(shared_rows), probs.shape[1],
                                     device=probs.device).exponential_()
    return (probs / noise).argmax(dim=-1)


def _top_k(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    k_max = int(top_ks.max())
    if k_max >= logits.shape[1]:
        # Some row has top-k disabled: threshold per row, only where enabled.
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(
            1, (top_ks.clamp(max=logits.shape[1]) - 1)[:, None])
    else:
        kth = logits.topk(k_max, dim=-1).values.gather(1, (top_ks - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p; always keep one.
    mass_before = probs.cumsum(dim=-1) - probs
    # (top_p == 1 rows keep all: a float cumsum can reach 1.0 before the tail.)
    drop = (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1.0)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
