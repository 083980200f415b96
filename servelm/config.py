"""Frozen configuration dataclasses, normalised once at start-up.

Owns: ModelConfig (from an HF config.json or GGUF metadata), CacheConfig, SchedulerConfig.
Never: mutated after start-up. Values found at run time (the number of KV blocks) are passed
explicitly, not written back here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from servelm.quant import quant_method_names  # torch-free: the registry's names

# HF `model_type` -> servelm model family. Families share code in models/.
_FAMILY_BY_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, in one normalised vocabulary."""

    architecture: str  # model family: "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Normalised rope scaling: None, or {"rope_type": "llama3"|"linear"|..., ...params}.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Normalise a Hugging Face config.json dictionary."""
        model_type = cfg.get("model_type", "")
        family = _FAMILY_BY_MODEL_TYPE.get(model_type)
        if family is None:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{sorted(_FAMILY_BY_MODEL_TYPE)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds theta in here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if isinstance(rope_scaling, dict):
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
        return cls(
            architecture=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=cfg.get("_name_or_path", "") or model_type,
        )


KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: fixed-size blocks; pool size from a memory budget."""

    block_size: int = 16
    # Bytes for the KV pool. None: `memory_fraction` of the memory free after loading weights.
    kv_cache_memory_bytes: int | None = None
    memory_fraction: float = 0.25
    # Hard cap on the number of blocks (tests use it to force preemption).
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # "auto": blocks in the model's dtype; "fp8": float8_e4m3fn codes with a static scale per
    # layer and KV head (servelm/runner/kv_cache.py): a block takes 1 byte per element.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: one token budget shared by decodes and prefill chunks."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")


SPEC_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to `num_tokens` tokens per sequence and the
    target scores them all in one step (servelm/spec/).

    method: "ngram" (prompt lookup, no model) or "draft" (a draft model: `draft_model`, a
    smaller model with the same tokenizer; or the target itself made cheaper: its first
    `draft_layers` layers plus its head, or a copy quantized with `draft_quantization`).
    adaptive: shrink k, or turn speculation off for a step, when the measured acceptance and
    step times say it no longer pays at the current batch size.
    """

    method: str
    num_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 2
    draft_model: str | None = None
    draft_layers: int | None = None
    draft_quantization: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if self.method == "draft":
            if (self.draft_model, self.draft_layers, self.draft_quantization) == (None,) * 3:
                raise ValueError("speculative method 'draft' needs --spec-draft-model, "
                                 "--spec-draft-layers or --spec-draft-quantization")
            if self.draft_layers is not None and (self.draft_model or self.draft_quantization):
                raise ValueError("spec_draft_layers drafts with the target's own layers: it "
                                 "takes no --spec-draft-model or --spec-draft-quantization")
            if self.draft_layers is not None and self.draft_layers < 1:
                raise ValueError(f"spec_draft_layers must be >= 1, got {self.draft_layers}")


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build an engine, as the CLI and the Python API take it."""

    model: str
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes
    memory_fraction: float = 0.25
    num_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "torch"
    cuda_graphs: bool = False  # capture decode steps (needs --device cuda, triton backend)
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    quantization: str | None = None  # weight-only method (servelm.quant): int8, int4-g32, gguf
    kv_cache_dtype: str = "auto"  # "fp8": KV blocks as float8_e4m3fn (CacheConfig)
    # Speculative decoding (servelm/spec/): None = off; "ngram" or "draft".
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    spec_ngram_max: int = 4
    spec_ngram_min: int = 2
    spec_draft_model: str | None = None
    spec_draft_layers: int | None = None
    spec_draft_quantization: str | None = None
    spec_adaptive: bool = True

    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative_method is None:
            return None
        return SpeculativeConfig(self.speculative_method, self.num_speculative_tokens,
                                 self.spec_ngram_max, self.spec_ngram_min,
                                 self.spec_draft_model, self.spec_draft_layers,
                                 self.spec_draft_quantization, self.spec_adaptive)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size,
                           kv_cache_memory_bytes=self.kv_cache_memory,
                           memory_fraction=self.memory_fraction,
                           num_blocks_override=self.num_blocks,
                           enable_prefix_caching=self.enable_prefix_caching,
                           kv_cache_dtype=self.kv_cache_dtype)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                               max_num_seqs=self.max_num_seqs,
                               enable_chunked_prefill=self.enable_chunked_prefill)


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2GB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    s = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    return int(s)


def add_engine_cli_args(parser) -> None:
    """Engine flags shared by `generate`, `chat`, `serve` and `bench`."""
    g = parser.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="bytes for the KV cache, e.g. 2GiB (default: a fraction of free memory)")
    g.add_argument("--memory-fraction", type=float, default=0.25,
                   help="share of free memory for the KV cache when --kv-cache-memory is unset")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false",
                   help="disable prefix caching (for comparison)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    g.add_argument("--cuda-graphs", action="store_true",
                   help="capture decode steps as CUDA graphs (GPU, triton backend)")
    g.add_argument("--engine-seed", dest="seed", type=int, default=0,
                   help="seed of the stream unseeded requests sample from")
    g.add_argument("--threads", dest="num_threads", type=int, default=None)
    g.add_argument("--quantization", default=None, choices=quant_method_names(),
                   help="quantization of the linear layers: weight-only int8/int4; 'gguf' "
                        "keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks as they are; 'fp8' is W8A8 "
                        "on CUDA sm89+ GPUs (default: float)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: 'auto' = the model's --dtype; 'fp8' = e4m3 codes "
                        "with a scale per layer and KV head (half the bytes of bf16)")
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", default=None, choices=SPEC_METHODS,
                   help="propose tokens with an n-gram lookup or a draft model and verify "
                        "them in one target step (default: off)")
    s.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="most draft tokens per sequence and step (k)")
    s.add_argument("--spec-ngram-max", type=int, default=4)
    s.add_argument("--spec-ngram-min", type=int, default=2)
    s.add_argument("--spec-draft-model", default=None,
                   help="draft model (cached name, GGUF file or HF dir; same tokenizer)")
    s.add_argument("--spec-draft-layers", type=int, default=None,
                   help="draft with the target's own first N layers and its head")
    s.add_argument("--spec-draft-quantization", default=None, choices=quant_method_names(),
                   help="draft with a copy of the target (or --spec-draft-model) quantized so")
    s.add_argument("--no-spec-adaptive", dest="spec_adaptive", action="store_false",
                   help="always speculate k tokens, even past the break-even batch")


def engine_args_from_cli(args) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(args).items() if k in names})
