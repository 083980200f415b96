"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama/Qwen use).

Owns the cos/sin table for every position up to the context length, with the rope scaling
variants Llama 3.x and linear-scaled checkpoints use.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from servelm.layers.fused_cpu import fused_ops


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":  # GGUF files store Llama 3 scaling as per-frequency divisors
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float64)
    raise ValueError(f"rope_scaling type {kind!r} is not supported "
                     f"(supported: linear, llama3, freq_factors)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp
    between `low_freq_factor` and `high_freq_factor`."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None):
        super().__init__()
        self._args = (head_dim, max_position, theta, scaling)
        cos, sin = self._table(None)  # on the meta device when built there
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _table(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim, max_position, theta, scaling = self._args
        inv_freq = _inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float64, device=device)
        freqs = torch.outer(positions, inv_freq.to(positions.device))
        cos, sin = freqs.cos().float(), freqs.sin().float()
        return (cos, sin) if device is None else (cos.to(device), sin.to(device))

    def materialize(self, device) -> None:
        """Recompute the tables after the module was built on the meta device."""
        self.cos, self.sin = self._table(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T]; q: [T, H, D]; k: [T, K, D] -> rotated (q, k).

        On the CPU in float32, q and k are rotated in place (they are fresh projections)."""
        ops = fused_ops(q)
        if (ops is not None and k.dtype == q.dtype and q.stride(-1) == 1 and k.stride(-1) == 1
                and positions.dtype == torch.long and positions.is_contiguous()):
            ops.rotary_(q, k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
