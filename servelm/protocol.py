"""Torch-free request and response types shared by the engine, the server and the tools.

Owns: SamplingParams (validated at construction), StructuredOutput (a constraint on the
output's form), ThinkingBudget (a cap on a request's thinking), EngineRequest, TokenDelta,
FinishReason, RequestTimings, RequestOutput/CompletionOutput.
Never: imports torch, or holds engine state.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any


class InvalidParameterError(ValueError):
    """Bad input. `param` names the offending parameter (OpenAI's `error.param`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model context
    ABORT = "abort"  # client abort or deadline


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the form of the output, enforced by token masks (servelm/structured/).

    kind  json_schema: `spec` is a JSON schema (text); json_object is the schema
                       {"type": "object"}
          regex:       `spec` is a regular expression the whole output matches
          choice:      `spec` is a JSON list of strings; the output is one of them
          grammar:     `spec` is a Lark grammar, or a GBNF (EBNF) one (`::=` rules)
    strict: json_schema only; True: a keyword the grammar library does not implement is an
            error, False: it is ignored (OpenAI's non-strict schemas are best effort).
    param: the request field it came from, named by errors about it.
    """

    kind: str
    spec: str
    strict: bool = True
    param: str = "response_format"

    KINDS = ("json_schema", "regex", "choice", "grammar")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise InvalidParameterError(f"{self.param}: unknown kind {self.kind!r} (expected "
                                        f"one of: {', '.join(self.KINDS)})", param=self.param)
        if not isinstance(self.spec, str) or not self.spec:
            raise InvalidParameterError(f"{self.param}: the {self.kind} must be a non-empty "
                                        "string", param=self.param)


@dataclass(frozen=True)
class ThinkingBudget:
    """A cap on a request's thinking, enforced by the engine (servelm/engine/thinking_budget.py):
    after `num_tokens` thinking tokens, `end_token_ids` (the reasoning parser's end tag) are
    appended in place of what the model sampled, and the answer goes on from there.

    start_token_ids: the tag the output opens its thinking with (an output that does not
                     start with it does not think); empty: the prompt opened the thinking, so
                     it starts at the first output token.
    The server builds it from its reasoning parser; the engine knows no tags.
    """

    num_tokens: int
    end_token_ids: list[int]
    start_token_ids: list[int] = field(default_factory=list)
    param: str = "thinking_token_budget"

    def __post_init__(self) -> None:
        n = self.num_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidParameterError(f"{self.param} must be a non-negative integer, got "
                                        f"{n!r}", param=self.param)
        if not self.end_token_ids:
            raise InvalidParameterError(f"{self.param} needs the end tag's token ids",
                                        param=self.param)


@dataclass
class SamplingParams:
    """How to sample one request. Validation names the parameter at fault."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: sampled token + k top alternatives
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    speculative: bool = True  # False: never speculate for this request (servelm/spec/)
    structured: StructuredOutput | None = None  # a grammar the output must follow
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # never generated
    prompt_logprobs: int | None = None  # logprob of each prompt token (+ k alternatives)
    pooling: str | None = None  # "mean" | "last": return the prompt's pooled hidden state
    # Thinking cut short at a budget. A request with one never speculates (speculative is
    # set false): the engine replaces a sampled token, and drafts scored after it would
    # follow the token it replaced.
    thinking_budget: ThinkingBudget | None = None
    # OpenAI's prompt_cache_retention: "24h" keeps the prompt's cached blocks ahead of
    # others in the prefix cache's eviction order for that long; "in_memory" is the default.
    prompt_cache_retention: str | None = None
    # Whose retention it is: each tenant keeps at most the engine's cap of retained blocks
    # (the server sets it from the OpenAI-Project header, else the API key; None: anonymous).
    prompt_cache_tenant: str | None = None

    MAX_LOGPROBS = 20
    POOLINGS = ("mean", "last")
    LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
    MAX_LOGIT_BIAS = 1024  # entries per request
    MAX_STOP_STRINGS = 16
    MAX_STOP_LEN = 256
    # A salt names a prefix-cache namespace (a tenant); its key lives as long as the
    # namespace holds a block, so its size is bounded like everything else a client sends.
    MAX_CACHE_SALT_LEN = 256
    SEED_RANGE = (-2**63, 2**63 - 1)  # a signed 64-bit integer, as OpenAI's API takes
    PROMPT_CACHE_RETENTIONS = {"in_memory": 0.0, "24h": 24 * 3600.0}  # -> seconds kept

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids or []]
        if self.thinking_budget is not None:
            self.speculative = False
        self.validate()

    @property
    def needs_prompt_states(self) -> bool:
        """The runner must compute every prompt position (none may come from the prefix
        cache): prompt logprobs and mean pooling read all of them."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def cache_retention_s(self) -> float:
        """Seconds the prompt's cached blocks are kept ahead of others (0: plain LRU)."""
        return self.PROMPT_CACHE_RETENTIONS.get(self.prompt_cache_retention, 0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidParameterError:
            return InvalidParameterError(f"{param} {msg}", param=param)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise bad(name, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                raise bad(name, f"must be finite, got {value!r}")
        for name in ("n", "min_tokens", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad(name, f"must be an integer, got {value!r}")
        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.max_tokens is not None:
            if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
                raise bad("max_tokens", f"must be an integer, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens "
                      f"({self.max_tokens})")
        if self.temperature < 0.0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                raise bad("seed", f"must be an integer, got {self.seed!r}")
            lo, hi = self.SEED_RANGE
            if not lo <= self.seed <= hi:
                raise bad("seed", f"must be in [-2**63, 2**63 - 1], got {self.seed}")
        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str):
                raise bad("cache_salt", f"must be a string, got {self.cache_salt!r}")
            if len(self.cache_salt) > self.MAX_CACHE_SALT_LEN:
                raise InvalidParameterError(
                    f"cache_salt must be at most {self.MAX_CACHE_SALT_LEN} characters, got "
                    f"{len(self.cache_salt)}", param="cache_salt", code="cache_salt_too_long")
        if self.logprobs is not None:
            if not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool):
                raise bad("logprobs", f"must be an integer, got {self.logprobs!r}")
            if not 0 <= self.logprobs <= self.MAX_LOGPROBS:
                raise bad("logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if len(self.stop) > self.MAX_STOP_STRINGS:
            raise bad("stop", f"has {len(self.stop)} strings; at most {self.MAX_STOP_STRINGS}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "entries must be non-empty strings")
            if len(s) > self.MAX_STOP_LEN:
                raise bad("stop", f"entries must be at most {self.MAX_STOP_LEN} characters")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
        self._validate_token_lists(bad)
        if self.prompt_logprobs is not None:
            if (not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
                    or not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS):
                raise bad("prompt_logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}], "
                          f"got {self.prompt_logprobs!r}")
        if self.pooling is not None and self.pooling not in self.POOLINGS:
            raise bad("pooling", f"must be one of {', '.join(self.POOLINGS)}, got "
                      f"{self.pooling!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise bad("structured", f"must be a StructuredOutput, got {self.structured!r}")
            if self.ignore_eos:
                # A finished structure leaves only EOS allowed: ignoring it has no output.
                raise InvalidParameterError(
                    f"ignore_eos cannot be combined with {self.structured.param}",
                    param="ignore_eos")
        retention = self.prompt_cache_retention
        if retention is not None and retention not in self.PROMPT_CACHE_RETENTIONS:
            raise bad("prompt_cache_retention", f"must be one of "
                      f"{', '.join(self.PROMPT_CACHE_RETENTIONS)}, got {str(retention)[:32]!r}")
        tenant = self.prompt_cache_tenant
        if tenant is not None and (not isinstance(tenant, str)
                                   or len(tenant) > self.MAX_CACHE_SALT_LEN):
            raise bad("prompt_cache_tenant", f"must be a string of at most "
                      f"{self.MAX_CACHE_SALT_LEN} characters, got {str(tenant)[:32]!r}")
        if self.thinking_budget is not None:
            if not isinstance(self.thinking_budget, ThinkingBudget):
                raise bad("thinking_budget", f"must be a ThinkingBudget, got "
                          f"{self.thinking_budget!r}")


    def _validate_token_lists(self, bad) -> None:
        def is_id(t) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and t >= 0

        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"has {len(self.logit_bias)} entries; at most "
                      f"{self.MAX_LOGIT_BIAS}")
        lo, hi = self.LOGIT_BIAS_RANGE
        for t, v in self.logit_bias.items():
            if not is_id(t):
                raise bad("logit_bias", f"keys must be token ids, got {t!r}")
            if (not isinstance(v, (int, float)) or isinstance(v, bool)
                    or not lo <= v <= hi):
                raise bad("logit_bias", f"values must be numbers in [-100, 100], got {v!r} "
                          f"for token {t}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty")
            if not all(is_id(t) for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be non-negative integers")
        for word in self.bad_words_token_ids:
            if not word or not all(is_id(t) for t in word):
                raise bad("bad_words", "entries must be non-empty lists of token ids")

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id the parameters name is in [0, vocab_size)."""
        for param, ids in (("stop_token_ids", self.stop_token_ids),
                           ("logit_bias", self.logit_bias),
                           ("allowed_token_ids", self.allowed_token_ids or []),
                           ("bad_words", [t for w in self.bad_words_token_ids for t in w])):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise InvalidParameterError(
                        f"{param}: token id {t} is outside the vocabulary [0, {vocab_size})",
                        param=param)


@dataclass
class RequestTimings:
    """Wall-clock instants (time.monotonic seconds) and counters of one request."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    prefill_time: float = 0.0  # seconds of steps spent on this request's prompt
    # KV tiers on: where the prompt's prefix came from and why (servelm/kv_tiers/
    # reload_policy.py CacheExplain.to_dict: tokens per tier, reload or recompute, estimates)
    cache_explain: dict[str, Any] | None = None

    @property
    def queued_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time

    def to_dict(self) -> dict[str, Any]:
        return {
            "queued_s": self.queued_s,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "prefill_s": self.prefill_time,
            "num_preemptions": self.num_preemptions,
            "num_cached_tokens": self.num_cached_tokens,
            **({"cache_explain": self.cache_explain} if self.cache_explain is not None else {}),
        }


@dataclass(frozen=True)
class RequestSLO:
    """The targets one request is served against: its SLO class, resolved from the SLO spec
    (servelm/slo.py) by whoever took the request. The SLO scheduling policy
    (servelm/engine/slo_policy.py) orders and admits by them; FCFS ignores them."""

    slo_class: str
    priority: int  # lower is served first
    ttft_s: float
    tpot_s: float
    reject_early: bool = True  # refuse at once when the TTFT cannot be met behind the queue


@dataclass
class ImageInput:
    """One image of a prompt, preprocessed (servelm/vision/processors.py): its placeholder
    tokens are prompt positions offset .. offset + num_tokens - 1, which the encoder's
    output embeddings replace. `hash` names its content (pixels and grid), so the runner's
    encoder cache and the prefix cache recognise the same image in any request."""

    hash: str
    offset: int
    num_tokens: int
    pixels: bytes  # float32 values, row-major, of `shape`
    shape: list[int]
    grid_thw: list[int] = field(default_factory=list)  # Qwen2-VL: patches in t, h, w


@dataclass
class EngineRequest:
    """What the engine is asked to do: token ids in, sampling rules."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float | None = None
    lora_name: str | None = None  # a loaded LoRA adapter to run with; None: the base model
    images: list[ImageInput] = field(default_factory=list)  # in prompt order
    slo: RequestSLO | None = None  # None: best effort (no class, served after every class)
    # Prefill/decode disaggregation (servelm/disagg/): this request's part in a KV transfer
    kv_transfer: KVTransferParams | None = None


@dataclass
class KVTransferParams:
    """A request's part in a KV transfer (docs/disaggregation.md). role "prefill": compute
    the prompt and keep its blocks for the decode worker that pulls transfer_id; role
    "decode": pull the prompt's blocks from the prefill worker at `source` (a KV address,
    e.g. tcp://10.0.0.5:9000), then continue the request."""

    transfer_id: str
    role: str
    source: str = ""


@dataclass
class Logprob:
    token_id: int
    logprob: float
    # top alternatives: (token_id, logprob), best first
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TokenDelta:
    """What one engine step produced for one sequence (choice `index`) of a request."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    timings: RequestTimings | None = None  # set on the request's last delta
    error: str | None = None
    # With the sequence's first token: one entry per prompt token, None for the first
    # (nothing precedes it), when SamplingParams.prompt_logprobs asked for them.
    prompt_logprobs: list[Logprob | None] | None = None
    embedding: list[float] | None = None  # SamplingParams.pooling: the pooled hidden state

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    embedding: list[float] | None = None


@dataclass
class RequestOutput:
    """A finished request, as returned by LLM.generate."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    timings: RequestTimings
