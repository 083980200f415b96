"""One serving replica's fixed choices: model, GPU kind, TP size, dtypes, memory policy,
calibration. Every subcommand that needs hardware takes a Deployment.

Owns: validating those inputs (errors name the flag), derived sizes (bytes per param, KV
bytes per token, effective peak FLOP/s and bandwidth), and choosing a default TP.
Never: answers a planning question itself.
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

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise PlanInputError("--tp", f"must be >= 1, got {self.tp}")
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
    def kv_shard(self) -> float:
        return kv_shard_factor(self.model, self.tp)

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

    def tier_bandwidth(self, tier: Tier) -> tuple[float, str]:
        """Tier -> this replica's GPUs: the slower of the medium and tp host links."""
        return tier_bandwidth(tier, self.gpu, self.tp,
                              storage_Bps=self.calibration.tier_bandwidth_Bps(tier.name),
                              host_link_Bps=self.calibration.host_link_bandwidth_Bps)

    def link_bandwidth(self, link: Link) -> Bandwidth:
        """The disaggregation link, one GPU's share, one direction."""
        bps = self.calibration.kv_link_bandwidth_Bps
        return (Bandwidth(link.bandwidth_Bps, link.name) if bps is None
                else Bandwidth(bps, f"{link.name} (set)"))

    def inputs(self) -> dict[str, Any]:
        out = {"model": self.model.name, "gpu": self.gpu.name, "tp": self.tp,
               "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype}
        if not self.calibration.is_assumed:
            out["calibration"] = self.calibration.source
        out.update(self.calibration.bandwidths_set())
        return out


def auto_tp(model: ModelConfig, gpu: Accelerator, weight_dtype: str, mem_util: float = 0.9,
            reserve_gb: float = 2.0, max_tp: int = 64) -> int:
    """Smallest power-of-two TP whose weight shard leaves at least a fifth of each GPU's
    usable memory for KV cache (a replica with no room for KV serves nobody)."""
    weight_bytes = count_params(model).total * dtype_bytes("--weight-dtype", weight_dtype)
    usable = gpu.memory_bytes * mem_util - reserve_gb * GB
    tp = 1
    while tp < max_tp and weight_bytes / tp > 0.8 * usable:
        tp *= 2
    return tp
