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

    def __post_init__(self) -> None:
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

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size,
                           kv_cache_memory_bytes=self.kv_cache_memory,
                           memory_fraction=self.memory_fraction,
                           num_blocks_override=self.num_blocks,
                           enable_prefix_caching=self.enable_prefix_caching)

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
                   help="weight-only quantization of the linear layers; 'gguf' keeps a GGUF "
                        "file's Q4_0/Q4_1/Q8_0 blocks as they are (default: float)")


def engine_args_from_cli(args) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(args).items() if k in names})
