"""Accelerator, link and storage-tier catalogs; every number carries its source.

Owns: Accelerator (memory, HBM bandwidth, dense bf16/fp8 FLOP/s, interconnect, host link),
the default CPU and GPU peaks the server's utilisation metrics assume (`default_peaks`),
Link (one-direction bandwidth), Tier (where cached KV or weights live, and the link they
come back over), their catalogs and name lookup.
Never: derates numbers. These are vendor peaks; achieved fractions belong to Calibration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servelm.planner.errors import PlanInputError

_NV = "https://www.nvidia.com/en-us/data-center/{}/"


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_Bps: float  # one direction, bytes/s
    source: str
    description: str = ""


@dataclass(frozen=True)
class Accelerator:
    """Dense (no 2:4 sparsity) peak numbers; decimal bytes."""

    name: str
    memory_bytes: float
    hbm_bandwidth_Bps: float
    bf16_flops: float
    fp8_flops: float | None  # None: no FP8 tensor cores (A100)
    interconnect: str  # Link name between GPUs of one node
    host_link: str  # Link name to host memory
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def peak_flops(self, compute_dtype: str) -> float:
        if compute_dtype == "fp8" and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops


def _src(datasheet: str, **numbers: str) -> dict[str, str]:
    return {k: f"{datasheet}: {v}" for k, v in numbers.items()}


_H100_DS = "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (" + _NV.format("h100") + ")"
_H200_DS = "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (" + _NV.format("h200") + ")"
_A100_DS = ("NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column ("
            + _NV.format("a100") + ")")
_L40S_DS = "NVIDIA L40S GPU datasheet (" + _NV.format("l40s") + ")"
_B200_DS = ("NVIDIA HGX B200 / DGX B200 datasheet, per GPU = 8-GPU totals / 8 ("
            + _NV.format("hgx") + ")")

ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("H100-SXM", 80e9, 3.35e12, 989e12, 1979e12, "nvlink4", "pcie5", _src(
        _H100_DS, memory_bytes="80 GB HBM3", hbm_bandwidth_Bps="3.35 TB/s",
        bf16_flops="1,979 TFLOPS with sparsity -> 989 dense",
        fp8_flops="3,958 TFLOPS with sparsity -> 1,979 dense",
        interconnect="NVLink 900 GB/s", host_link="PCIe Gen5 128 GB/s")),
    Accelerator("H200", 141e9, 4.8e12, 989e12, 1979e12, "nvlink4", "pcie5", _src(
        _H200_DS, memory_bytes="141 GB HBM3e", hbm_bandwidth_Bps="4.8 TB/s",
        bf16_flops="1,979 TFLOPS with sparsity -> 989 dense",
        fp8_flops="3,958 TFLOPS with sparsity -> 1,979 dense",
        interconnect="NVLink 900 GB/s", host_link="PCIe Gen5 128 GB/s")),
    Accelerator("A100-80GB", 80e9, 2.039e12, 312e12, None, "nvlink3", "pcie4", _src(
        _A100_DS, memory_bytes="80 GB HBM2e", hbm_bandwidth_Bps="2,039 GB/s",
        bf16_flops="312 TFLOPS (624 with sparsity)", fp8_flops="no FP8 tensor cores",
        interconnect="NVLink 600 GB/s", host_link="PCIe Gen4 64 GB/s")),
    Accelerator("L40S", 48e9, 864e9, 362.05e12, 733e12, "pcie4", "pcie4", _src(
        _L40S_DS, memory_bytes="48 GB GDDR6", hbm_bandwidth_Bps="864 GB/s",
        bf16_flops="362.05 TFLOPS (733 with sparsity)",
        fp8_flops="733 TFLOPS (1,466 with sparsity)",
        interconnect="no NVLink; PCIe Gen4 x16 64 GB/s bidirectional",
        host_link="PCIe Gen4 x16")),
    Accelerator("B200", 180e9, 8e12, 2.25e15, 4.5e15, "nvlink5", "pcie5", _src(
        _B200_DS, memory_bytes="1,440 GB HBM3e per 8 GPUs",
        hbm_bandwidth_Bps="64 TB/s per 8 GPUs",
        bf16_flops="36 PFLOPS with sparsity per 8 GPUs -> 2.25 PFLOPS dense per GPU",
        fp8_flops="72 PFLOPS with sparsity per 8 GPUs -> 4.5 PFLOPS dense per GPU",
        interconnect="NVLink 5, 1.8 TB/s per GPU", host_link="PCIe Gen5")),
)}


@dataclass(frozen=True)
class HostCpu:
    """The peaks the server's utilisation metrics assume on a CPU when not told
    (--peak-bandwidth / --peak-flops): a modest socket, not a measured one."""

    name: str
    dram_bandwidth_Bps: float
    fp32_flops: float
    sources: dict[str, str] = field(default_factory=dict, compare=False)


DEFAULT_CPU = HostCpu("cpu", 50e9, 1e12, {
    "dram_bandwidth_Bps": "assumed: a few DDR4/DDR5 channels of one socket (one DDR5-4800 "
                          "channel is 38.4 GB/s, JEDEC); pass --peak-bandwidth for yours",
    "fp32_flops": "assumed: ~16 cores x 2 AVX-512 FMA units x 16 lanes x 2 FLOP x ~1 GHz "
                  "sustained; pass --peak-flops for yours"})
# The GPU the server assumes on CUDA when not told: the planner's default --gpu.
DEFAULT_GPU = "H100-SXM"


def default_peaks(device_type: str) -> tuple[float, float]:
    """(bytes/s, FLOP/s) the server's utilisation metrics divide by on `device_type`
    ("cuda": DEFAULT_GPU's HBM bandwidth and dense bf16 FLOP/s; else DEFAULT_CPU)."""
    if device_type == "cuda":
        gpu = ACCELERATORS[DEFAULT_GPU]
        return gpu.hbm_bandwidth_Bps, gpu.bf16_flops
    return DEFAULT_CPU.dram_bandwidth_Bps, DEFAULT_CPU.fp32_flops


_PCIE = "PCI-SIG base spec: {} GT/s per lane x 16 lanes, 128b/130b encoding, one direction"
LINKS: dict[str, Link] = {link.name: link for link in (
    Link("nvlink3", 300e9, _A100_DS + ": NVLink 600 GB/s bidirectional -> 300 one way",
         "NVLink 3 (A100), GPU to GPU in a node"),
    Link("nvlink4", 450e9, _H100_DS + ": NVLink 900 GB/s bidirectional -> 450 one way",
         "NVLink 4 (H100/H200), GPU to GPU in a node"),
    Link("nvlink5", 900e9, _B200_DS + ": NVLink 1.8 TB/s per GPU bidirectional -> 900 one way",
         "NVLink 5 (B200), GPU to GPU in a node"),
    Link("nic-400g", 50e9, "NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand: 400 Gb/s = 50 GB/s",
         "one 400 Gb/s NIC per GPU (RDMA), node to node"),
    Link("nic-100g", 12.5e9, "100 Gb/s Ethernet line rate = 12.5 GB/s",
         "one 100 Gb/s NIC, node to node"),
    Link("pcie4", 31.5e9, _PCIE.format(16), "PCIe Gen4 x16, host <-> GPU"),
    Link("pcie5", 63e9, _PCIE.format(32), "PCIe Gen5 x16, host <-> GPU"),
    Link("nvme", 7e9, "PCIe Gen4 x4 NVMe SSD sequential read, e.g. Samsung 990 PRO datasheet "
         "7,450 MB/s (rounded down)", "one Gen4 NVMe drive"),
    Link("nvme-gen5", 14e9, "PCIe Gen5 x4 NVMe SSD sequential read, e.g. Crucial T705 "
         "datasheet 14,500 MB/s (rounded down)", "one Gen5 NVMe drive"),
    Link("ddr5", 307e9, "8 channels DDR5-4800 x 38.4 GB/s per channel (JEDEC DDR5) = 307 GB/s",
         "one CPU socket's DRAM"),
)}


@dataclass(frozen=True)
class Tier:
    """Where bytes rest outside HBM: `storage` is read at its link speed and then crosses
    each GPU's host link (in parallel across the replica's GPUs)."""

    name: str
    storage: str  # Link name of the medium itself
    description: str


TIERS: dict[str, Tier] = {t.name: t for t in (
    Tier("dram", "ddr5", "host DRAM (pinned memory / page cache)"),
    Tier("nvme", "nvme", "local NVMe SSD"),
    Tier("network", "nic-400g", "remote store over a 400 Gb/s NIC"),
)}


def _lookup(table: dict, kind: str, flag: str, name: str):
    by_lower = {k.lower(): v for k, v in table.items()}
    aliases = {"h100": "h100-sxm", "a100": "a100-80gb", "nvlink": "nvlink4",
               "400g": "nic-400g", "nic": "nic-400g", "pcie": "pcie5"}
    key = name.lower()
    hit = by_lower.get(key) or by_lower.get(aliases.get(key, ""))
    if hit is None:
        raise PlanInputError(flag, f"unknown {kind} {name!r}; choose from {', '.join(table)}")
    return hit


def get_accelerator(name: str) -> Accelerator:
    return _lookup(ACCELERATORS, "GPU", "--gpu", name)


def get_link(name: str) -> Link:
    return _lookup(LINKS, "link", "--link", name)


def get_tier(name: str) -> Tier:
    return _lookup(TIERS, "tier", "--tier", name)


def tier_bandwidth(tier: Tier, gpu: Accelerator, num_gpus: float, *,
                   storage_Bps: float | None = None,
                   host_link_Bps: float | None = None) -> tuple[float, str]:
    """Effective bytes/s from a tier into `num_gpus` GPUs: the slower of the medium and
    the GPUs' host links together. Returns (bandwidth, which side limits). storage_Bps and
    host_link_Bps replace the catalog's figures (measured or set by the user)."""
    storage = LINKS[tier.storage].bandwidth_Bps if storage_Bps is None else storage_Bps
    medium = tier.storage if storage_Bps is None else f"{tier.name} (set)"
    one = LINKS[gpu.host_link].bandwidth_Bps if host_link_Bps is None else host_link_Bps
    link = gpu.host_link if host_link_Bps is None else "host link (set)"
    host = one * num_gpus
    if storage <= host:
        return storage, f"{medium} ({storage / 1e9:g} GB/s)"
    return host, f"{num_gpus:g} x {link} ({host / 1e9:g} GB/s)"
