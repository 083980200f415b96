"""One serving replica's fixed choices: model, GPU kind, TP size, how attention is split
across those GPUs, dtypes, memory policy, calibration. Every subcommand that needs hardware
takes a Deployment.

Owns: validating those inputs (errors name the flag), derived sizes (bytes per param, KV
bytes per token, weight bytes and KV tokens per GPU under tensor- or data-parallel
attention, effective peak FLOP/s and bandwidth), and choosing a default TP and attention
split.
Never: answers a planning question itself.

Attention across the replica's `tp` GPUs ("tp" below is the replica's GPU count either way):

    tp  every GPU holds 1/tp of each layer, attention heads included; a token's KV is split
        by KV head, never below one head per GPU, so MLA's single latent is on every GPU
    dp  every GPU holds all the attention weights and runs attention for its own requests,
        whose whole KV it holds; the MLPs / experts stay split across the tp GPUs
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from servelm.config import ModelConfig
from servelm.cost import count_params, kv_bytes_per_token
from servelm.planner.calibration import Calibration
from servelm.planner.compute import compute_dtype, kv_shard_factor
from servelm.planner.errors import (
    PlanInputError,
    require_fraction,
    require_non_negative,
)
from servelm.planner.hardware import LINKS, Accelerator, Link, Tier, tier_bandwidth
from servelm.planner.units import GB, KV_DTYPES, dtype_bytes


ATTENTION_PARALLEL = ("dp", "tp")


def default_attention_parallel(model: ModelConfig) -> str:
    """dp for MLA models: TP cannot split a latent that every head reads, so engines serve
    DeepSeek-style models with data-parallel attention (SGLang's --enable-dp-attention,
    vLLM's data-parallel attention with expert parallelism); tp for the rest."""
    return "dp" if model.is_mla else "tp"


def resolve_attention_parallel(model: ModelConfig, value: str | None) -> str:
    """None -> the model's default; anything but dp/tp is an error naming the flag."""
    value = default_attention_parallel(model) if value is None else value
    if value not in ATTENTION_PARALLEL:
        raise PlanInputError("--attention-parallel", f"must be dp or tp, got {value!r}")
    return value


def kv_split(model: ModelConfig, tp: int, attention_parallel: str) -> tuple[float, float]:
    """(kv_shard, kv_copies): ways one token's KV is split across the replica's GPUs, and
    copies of it the replica holds. dp: (1, 1), the token sits whole on one GPU; tp: KV heads
    split but never below one per GPU, so (kv_heads / ceil(kv_heads / tp), tp / kv_shard);
    MLA at TP 8: (1, 8), one latent per GPU."""
    if attention_parallel == "dp":
        return 1.0, 1.0
    shard = kv_shard_factor(model, tp)
    return shard, tp / shard


class Bandwidth(NamedTuple):
    Bps: float
    label: str  # what the number is: a catalog link name, or "... (set)" when calibrated


@dataclass(frozen=True)
class Deployment:
    model: ModelConfig
    gpu: Accelerator
    tp: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    mem_util: float = 0.9
    reserve_gb: float = 2.0
    calibration: Calibration = field(default_factory=Calibration)
    attention_parallel: str | None = None  # "dp" or "tp"; None: the model's default

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise PlanInputError("--tp", f"must be >= 1, got {self.tp}")
        object.__setattr__(self, "attention_parallel",  # normalised once, as configs are
                           resolve_attention_parallel(self.model, self.attention_parallel))
        dtype_bytes("--weight-dtype", self.weight_dtype)
        dtype_bytes("--kv-dtype", self.kv_dtype, KV_DTYPES)
        require_fraction("--mem-util", self.mem_util)
        require_non_negative("--reserve-gb", self.reserve_gb)

    @property
    def bytes_per_param(self) -> float:
        return dtype_bytes("--weight-dtype", self.weight_dtype)

    @property
    def kv_dtype_bytes(self) -> float:
        return dtype_bytes("--kv-dtype", self.kv_dtype, KV_DTYPES)

    @property
    def weight_bytes(self) -> float:
        return count_params(self.model).total * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.model, self.kv_dtype_bytes)

    @property
    def is_dp_attention(self) -> bool:
        return self.attention_parallel == "dp"

    @property
    def attention_weight_bytes(self) -> float:
        """All layers' attention projections (one copy)."""
        return (self.model.num_layers * count_params(self.model).attention_per_layer
                * self.bytes_per_param)

    @property
    def weight_bytes_per_gpu(self) -> float:
        """tp: 1/tp of everything; dp: all the attention + 1/tp of the rest."""
        if not self.is_dp_attention:
            return self.weight_bytes / self.tp
        attn = self.attention_weight_bytes
        return attn + (self.weight_bytes - attn) / self.tp

    @property
    def attention_copies(self) -> int:
        """Copies of the attention weights in the replica (each read every step)."""
        return self.tp if self.is_dp_attention else 1

    @property
    def kv_shard(self) -> float:
        """Ways one token's KV is split across GPUs (see kv_split)."""
        return kv_split(self.model, self.tp, self.attention_parallel)[0]

    @property
    def kv_copies(self) -> float:
        """Copies of each token's KV the replica holds (see kv_split)."""
        return kv_split(self.model, self.tp, self.attention_parallel)[1]

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        """On each GPU that holds the token."""
        return self.kv_bytes_per_token / self.kv_shard

    @property
    def kv_pool_bytes_per_gpu(self) -> float:
        return max(self.usable_bytes_per_gpu - self.weight_bytes_per_gpu, 0.0)

    @property
    def kv_tokens_per_gpu(self) -> int:
        """dp: tokens of this GPU's own requests; tp: every GPU holds a slice of the same
        tokens, so this is also the replica's count."""
        return int(self.kv_pool_bytes_per_gpu // self.kv_bytes_per_token_per_gpu)

    @property
    def kv_tokens_per_replica(self) -> int:
        return self.kv_tokens_per_gpu * (self.tp if self.is_dp_attention else 1)

    def sequences_per_replica(self, tokens_per_seq: int) -> int:
        """Sequences of `tokens_per_seq` KV tokens the replica holds at once; under dp a
        sequence cannot span GPUs, so each GPU's pool is divided on its own."""
        if self.is_dp_attention:
            return self.tp * (self.kv_tokens_per_gpu // tokens_per_seq)
        return self.kv_tokens_per_replica // tokens_per_seq

    @property
    def compute_dtype(self) -> str:
        return compute_dtype(self.weight_dtype, self.gpu)

    @property
    def peak_flops(self) -> float:
        """Per GPU, dense, in the compute dtype."""
        return self.gpu.peak_flops(self.compute_dtype)

    @property
    def usable_bytes_per_gpu(self) -> float:
        return self.gpu.memory_bytes * self.mem_util - self.reserve_gb * GB

    # Tier and link bandwidths: the calibration's (file or flag) where set, else the catalog.

    def storage_bandwidth(self, tier: Tier) -> Bandwidth:
        """The medium a tier's bytes rest on (DRAM, a disk, a remote store)."""
        bps = self.calibration.tier_bandwidth_Bps(tier.name)
        if bps is None:
            return Bandwidth(LINKS[tier.storage].bandwidth_Bps, tier.storage)
        return Bandwidth(bps, f"{tier.name} (set)")

    @property
    def host_link(self) -> Bandwidth:
        """One GPU's link to host memory (PCIe)."""
        bps = self.calibration.host_link_bandwidth_Bps
        if bps is None:
            return Bandwidth(LINKS[self.gpu.host_link].bandwidth_Bps, self.gpu.host_link)
        return Bandwidth(bps, "host link (set)")

    def kv_tier_bandwidth(self, tier: Tier) -> tuple[float, str]:
        """A request's KV from a tier into the GPUs that hold it: the slower of the medium and
        kv_shard host links in parallel (each GPU's link carries its shard; a whole MLA
        latent or a dp-attention request goes over one GPU's link)."""
        return tier_bandwidth(tier, self.gpu, self.kv_shard,
                              storage_Bps=self.calibration.tier_bandwidth_Bps(tier.name),
                              host_link_Bps=self.calibration.host_link_bandwidth_Bps)

    def link_bandwidth(self, link: Link) -> Bandwidth:
        """The disaggregation link, one GPU's share, one direction."""
        bps = self.calibration.kv_link_bandwidth_Bps
        return (Bandwidth(link.bandwidth_Bps, link.name) if bps is None
                else Bandwidth(bps, f"{link.name} (set)"))

    def inputs(self) -> dict[str, Any]:
        out = {"model": self.model.name, "gpu": self.gpu.name, "tp": self.tp,
               "attention_parallel": self.attention_parallel,
               "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype}
        if not self.calibration.is_assumed:
            out["calibration"] = self.calibration.source
        out.update(self.calibration.bandwidths_set())
        return out


def auto_tp(model: ModelConfig, gpu: Accelerator, weight_dtype: str, mem_util: float = 0.9,
            reserve_gb: float = 2.0, max_tp: int = 64,
            attention_parallel: str | None = None) -> int:
    """Smallest power-of-two TP whose weights per GPU leave at least a fifth of each GPU's
    usable memory for KV cache (a replica with no room for KV serves nobody)."""
    def shard(tp: int) -> float:
        return Deployment(model, gpu, tp=tp, weight_dtype=weight_dtype,
                          attention_parallel=attention_parallel).weight_bytes_per_gpu

    usable = gpu.memory_bytes * mem_util - reserve_gb * GB
    tp = 1
    while tp < max_tp and shard(tp) > 0.8 * usable:
        tp *= 2
    return tp
