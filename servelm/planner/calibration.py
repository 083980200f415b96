"""Efficiencies and measured bandwidths that turn peak-hardware bounds into estimates.

Owns: Calibration (achieved HBM-bandwidth fraction, prefill and decode MFU, per-step
overhead, start-up stage times, and the tier and link bandwidths when measured or set)
with assumption defaults, and loading it from JSON, the shape `servelm bench calibrate`
writes.
Never: reads benchmark traces itself; bench produces the file, the planner only reads it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from servelm.planner.errors import (
    PlanInputError,
    require_fraction,
    require_non_negative,
    require_positive,
)

# Bandwidth keys (bytes/s, None: the catalog figure) and the flag that sets each, in GB/s.
BANDWIDTH_FLAGS: dict[str, str] = {
    "host_memory_bandwidth_Bps": "--dram-bw",  # the dram tier's medium
    "disk_bandwidth_Bps": "--disk-bw",  # the nvme tier's medium
    "network_bandwidth_Bps": "--network-bw",  # the network tier's medium (a remote store)
    "host_link_bandwidth_Bps": "--pcie-bw",  # each GPU's link to host memory
    "kv_link_bandwidth_Bps": "--link-bw",  # disagg: prefill -> decode, per GPU
}
# Which bandwidth key replaces each storage tier's medium.
TIER_BANDWIDTH_KEYS: dict[str, str] = {"dram": "host_memory_bandwidth_Bps",
                                       "nvme": "disk_bandwidth_Bps",
                                       "network": "network_bandwidth_Bps"}


@dataclass(frozen=True)
class Calibration:
    # Defaults make decode a true lower bound (peak bandwidth and FLOPs, no overhead) and
    # prefill a common planning assumption (~50% MFU for large-batch bf16 GEMMs on H100).
    bandwidth_fraction: float = 1.0
    decode_mfu: float = 1.0
    prefill_mfu: float = 0.5
    step_overhead_s: float = 0.0  # scheduler + launch time per engine step
    # Cold-start stages that are not bytes over a link (assumptions from typical vLLM
    # start-up logs on one node; measure yours and put them here).
    runtime_init_s: float = 15.0  # interpreter, CUDA context, NCCL/process-group init
    warmup_s: float = 5.0  # profiling forward pass, KV-cache allocation, kernel autotune
    graph_capture_s_per_size: float = 0.15
    num_graph_sizes: int = 67  # vLLM default: 1, 2, 4, 8..256 step 8, 272..512 step 16
    # Tier and link bandwidths, bytes/s; None keeps the catalog's figure (hardware.py).
    host_memory_bandwidth_Bps: float | None = None
    disk_bandwidth_Bps: float | None = None
    network_bandwidth_Bps: float | None = None
    host_link_bandwidth_Bps: float | None = None
    kv_link_bandwidth_Bps: float | None = None
    source: str = "assumed defaults"

    def __post_init__(self) -> None:
        for name in ("bandwidth_fraction", "decode_mfu", "prefill_mfu"):
            require_fraction(f"calibration.{name}", getattr(self, name))
        for name in ("step_overhead_s", "runtime_init_s", "warmup_s",
                     "graph_capture_s_per_size", "num_graph_sizes"):
            require_non_negative(f"calibration.{name}", getattr(self, name))
        for name in BANDWIDTH_FLAGS:
            if getattr(self, name) is not None:
                require_positive(f"calibration.{name}", getattr(self, name))

    @property
    def is_assumed(self) -> bool:
        return self.source == "assumed defaults"

    def bandwidths_set(self) -> dict[str, float]:
        """The bandwidths that replace catalog figures, by key."""
        return {k: getattr(self, k) for k in BANDWIDTH_FLAGS if getattr(self, k) is not None}

    def tier_bandwidth_Bps(self, tier_name: str) -> float | None:
        key = TIER_BANDWIDTH_KEYS.get(tier_name)
        return getattr(self, key) if key else None


def load_calibration(path: str | Path | None) -> Calibration:
    """None -> defaults. Unknown keys are an error so a typo cannot silently fall back."""
    if path is None:
        return Calibration()
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanInputError("--calibration", f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise PlanInputError("--calibration", "expected a JSON object")
    known = {f.name for f in dataclasses.fields(Calibration)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanInputError("--calibration", f"unknown keys {unknown}; known: {sorted(known)}")
    data.setdefault("source", str(path))
    try:
        return Calibration(**data)
    except TypeError as e:
        raise PlanInputError("--calibration", str(e)) from e
