"""Seeded offline workloads: prompts as token-id lists, so every system does the same work.

Owns: Request, parse_range, random_lengths (and RandomPrompts, the same drawn lazily), the
online workloads. Every generator takes the vocabulary its ids are drawn from: the served
model's (servelm/bench/vocab.py finds it), never a default that fits one model only.
Never: imports torch or the servelm engine. Peer benchmark scripts run in other virtual
environments and load this file by path, so it may use only the standard library and numpy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Token ids below this and at or above vocab_size - SPECIAL_MARGIN are not drawn: small
# vocabularies keep their special tokens (BOS, EOS, chat markers) at the ends.
SPECIAL_MARGIN = 100


class Request(NamedTuple):
    prompt_token_ids: list[int]
    max_tokens: int


class RangeError(ValueError):
    """A bad "A:B" range, count or vocabulary size. `param` names the flag or argument at
    fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_vocab_size(vocab_size: int, param: str = "vocab_size") -> None:
    """Ids are drawn from [SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN): that must hold one."""
    if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool) \
            or vocab_size <= 2 * SPECIAL_MARGIN:
        raise RangeError(f"{param} must be an integer above {2 * SPECIAL_MARGIN}, got "
                         f"{vocab_size!r}", param)


def parse_range(text: str | int | tuple[int, int], param: str = "range") -> tuple[int, int]:
    """"A:B" -> (A, B); "A" -> (A, A). Both ends are inclusive, positive and A <= B."""
    if isinstance(text, tuple):
        lo, hi = text
    elif isinstance(text, int) and not isinstance(text, bool):
        lo = hi = text
    elif isinstance(text, str):
        parts = text.strip().split(":")
        if len(parts) not in (1, 2) or not all(p.strip() for p in parts):
            raise RangeError(f"{param} must be 'A' or 'A:B' (integers), got {text!r}", param)
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise RangeError(f"{param} must be 'A' or 'A:B' (integers), got {text!r}",
                             param) from None
        lo, hi = values[0], values[-1]
    else:
        raise RangeError(f"{param} must be 'A' or 'A:B', got {text!r}", param)
    if lo < 1:
        raise RangeError(f"{param} must be at least 1, got {lo}", param)
    if lo > hi:
        raise RangeError(f"{param} lower bound {lo} exceeds upper bound {hi}", param)
    return int(lo), int(hi)


def format_range(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}:{r[1]}"


def random_lengths(num_prompts: int, input_len: tuple[int, int] | str,
                   output_len: tuple[int, int] | str, vocab_size: int,
                   seed: int = 0) -> list[Request]:
    """`num_prompts` prompts of random token ids with lengths uniform in the given ranges,
    drawn from the model's vocabulary of `vocab_size` ids (less SPECIAL_MARGIN at each end).

    The same arguments give the same requests on every machine (numpy's PCG64).
    """
    return list(RandomPrompts(num_prompts, input_len, output_len, vocab_size, seed))


class RandomPrompts:
    """random_lengths' requests drawn one at a time as they are iterated (each iteration
    draws them afresh, the same ones), for a run that should not hold them all: a simulated
    fleet's millions.

    windows: the same lengths, but prompt i is the window [i, i + length) of one random
    pool of ids drawn after them, instead of ids of its own: no two prompts share a first
    block, as no two of random_lengths' do, so a prefix cache (which compares nothing else)
    finds as little; a prompt is then its list of pointers into the pool (8 bytes an id,
    not 36) and costs a slice to make, not a draw (servelm sim's random workload: the same
    timings as random_lengths' prompts give, tests/sim/test_speed.py)."""

    def __init__(self, num_prompts: int, input_len: tuple[int, int] | str,
                 output_len: tuple[int, int] | str, vocab_size: int, seed: int = 0,
                 windows: bool = False):
        if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) \
                or num_prompts < 1:
            raise RangeError(f"num_prompts must be a positive integer, got {num_prompts!r}",
                             "num_prompts")
        self.input_len = parse_range(input_len, "input_len")
        self.output_len = parse_range(output_len, "output_len")
        check_vocab_size(vocab_size)
        self.num_prompts, self.vocab_size, self.seed = num_prompts, vocab_size, seed
        self.windows = windows

    def __len__(self) -> int:
        return self.num_prompts

    def __iter__(self):
        (in_lo, in_hi), (out_lo, out_hi) = self.input_len, self.output_len
        rng = np.random.default_rng(self.seed)
        input_lens = rng.integers(in_lo, in_hi + 1, size=self.num_prompts).tolist()
        output_lens = rng.integers(out_lo, out_hi + 1, size=self.num_prompts).tolist()
        lo, hi = SPECIAL_MARGIN, self.vocab_size - SPECIAL_MARGIN
        if self.windows:
            pool = rng.integers(lo, hi, size=self.num_prompts + in_hi).tolist()
            for i, (n_in, n_out) in enumerate(zip(input_lens, output_lens)):
                yield Request(pool[i:i + n_in], n_out)
            return
        for n_in, n_out in zip(input_lens, output_lens):
            ids = rng.integers(lo, hi, size=n_in)
            yield Request(ids.tolist(), n_out)  # Python ints, as int(t) each


# --- online workloads (`servelm bench serve`); appended, shared with `bench offline` -------


def _lognormal_lengths(rng: np.random.Generator, n: int, lo: int, hi: int, median: float,
                       sigma: float) -> np.ndarray:
    """Long-tailed lengths: lognormal around `median`, clipped to [lo, hi]."""
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, size=n)), lo, hi).astype(int)


def conversation(num_prompts: int, input_len: tuple[int, int] | str,
                 output_len: tuple[int, int] | str, vocab_size: int, seed: int = 0, *,
                 turns: tuple[int, int] = (1, 6), input_median: float = 96,
                 output_median: float = 128, sigma: float = 1.0,
                 max_prompt_len: int = 4096) -> list[Request]:
    """`num_prompts` chat turns: long-tailed user and assistant lengths (lognormal, clipped
    to `input_len` / `output_len`), grouped into conversations of `turns` turns.

    Turn k's prompt is the whole history: user_1 + assistant_1 + ... + user_k, so every turn
    extends the previous turn's prompt and a prefix cache can reuse it. The assistant tokens
    in the history are seeded stand-ins, not what the server generated: the requests stay the
    same on every run and every system, at the cost that only the previous *prompt* (not its
    answer) is a cache hit. Turns are interleaved round-robin across the open conversations,
    the way concurrent users take turns, so a history is revisited a few requests later.
    """
    if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 1:
        raise RangeError(f"num_prompts must be a positive integer, got {num_prompts!r}",
                         "num_prompts")
    in_lo, in_hi = parse_range(input_len, "input_len")
    out_lo, out_hi = parse_range(output_len, "output_len")
    t_lo, t_hi = parse_range(turns, "turns")
    check_vocab_size(vocab_size)
    rng = np.random.default_rng(seed)

    def draw_ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN,
                                             size=int(n))]

    conversations: list[list[Request]] = []
    total = 0
    while total < num_prompts:
        num_turns = int(rng.integers(t_lo, t_hi + 1))
        user_lens = _lognormal_lengths(rng, num_turns, in_lo, in_hi, input_median, sigma)
        reply_lens = _lognormal_lengths(rng, num_turns, out_lo, out_hi, output_median, sigma)
        history: list[int] = []
        conv = []
        for n_user, n_reply in zip(user_lens, reply_lens):
            prompt = history + draw_ids(n_user)
            if len(prompt) > max_prompt_len or total >= num_prompts:
                break
            conv.append(Request(prompt, int(n_reply)))
            total += 1
            history = prompt + draw_ids(n_reply)
        if conv:
            conversations.append(conv)
    requests: list[Request] = []
    for turn in range(max(len(c) for c in conversations)):
        requests.extend(c[turn] for c in conversations if turn < len(c))
    return requests


def documents(num_prompts: int, input_len: tuple[int, int] | str,
              output_len: tuple[int, int] | str, vocab_size: int,
              seed: int = 0) -> list[Request]:
    """A document batch: `num_prompts` documents of `input_len` tokens, each followed by the
    same short instruction (a shared suffix, not a shared prefix: no cache help), summarised
    in `output_len` tokens. `bench serve` submits them all at once and times the last one."""
    docs = random_lengths(num_prompts, input_len, output_len, vocab_size, seed)
    rng = np.random.default_rng(seed + 1)
    instruction = [int(t) for t in rng.integers(SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN,
                                                size=16)]
    return [Request(d.prompt_token_ids + instruction, d.max_tokens) for d in docs]


_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "do", "fu", "gi",
              "ha", "ji", "ko", "pe"]


def word_of(token_id: int) -> str:
    """A deterministic pronounceable word per token id (two to four syllables), for servers
    that take only text. The server's tokenizer will not give back exactly one token per
    word; the usage fields report what it counted."""
    n = len(_SYLLABLES)
    i = int(token_id)
    parts = [_SYLLABLES[i % n], _SYLLABLES[(i // n) % n]]
    i //= n * n
    while i:
        parts.append(_SYLLABLES[i % n])
        i //= n
    return "".join(parts)


def prompt_text(token_ids: list[int]) -> str:
    return " ".join(word_of(t) for t in token_ids)


def shared_prefix(num_prompts: int, prefix_len: int, suffix_len: int,
                  output_len: tuple[int, int] | str, vocab_size: int,
                  seed: int = 0) -> list[Request]:
    """`num_prompts` requests = one common prefix of `prefix_len` tokens (a long system
    prompt) + a unique suffix of `suffix_len` tokens. With a prefix cache the prefix is
    prefilled once: the work saved is about prefix_len * (num_prompts - 1) tokens."""
    if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 1:
        raise RangeError(f"num_prompts must be a positive integer, got {num_prompts!r}",
                         "num_prompts")
    for name, value in (("prefix_len", prefix_len), ("suffix_len", suffix_len)):
        if not isinstance(value, int) or value < 0:
            raise RangeError(f"{name} must be a non-negative integer, got {value!r}", name)
    out_lo, out_hi = parse_range(output_len, "output_len")
    check_vocab_size(vocab_size)
    rng = np.random.default_rng(seed)
    draw = lambda n: [int(t) for t in rng.integers(SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN,  # noqa: E731
                                                   size=n)]
    prefix = draw(prefix_len)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    return [Request(prefix + draw(suffix_len), int(n)) for n in out_lens]
