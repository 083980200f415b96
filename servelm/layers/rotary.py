"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama/Qwen use).

Owns the cos/sin table for every position up to the context length, with the rope scaling
variants checkpoints use: linear, Llama 3.x, YaRN (Qwen2.5 long context, DeepSeek) and
LongRoPE (Phi-3). YaRN's and LongRoPE's attention factor is folded into the table. A partial
rotary (rotary_dim < head_dim) rotates the leading rotary_dim channels of each head.

LongRoPE has two sets of per-frequency factors: positions below the original context take the
short ones, positions from there on the long ones. (Transformers' Phi-3 instead re-encodes the
whole sequence with the long factors once it passes the original context; the two agree below
it.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from servelm.layers.fused_cpu import fused_ops


ROPE_TYPES = ("linear", "llama3", "freq_factors", "yarn", "longrope")


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
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported "
                     f"(supported: {', '.join(ROPE_TYPES)})")


def _yarn_factor(s: dict[str, Any], max_position: int) -> float:
    factor = s.get("factor")
    return float(factor if factor is not None
                 else max_position / float(s["original_max_position_embeddings"]))


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float,
                   s: dict[str, Any]) -> torch.Tensor:
    """Interpolate the long wavelengths by `factor`, keep the short ones (extrapolate), a
    linear ramp between the beta_fast and beta_slow rotation counts."""
    factor = float(s["_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate


def _attention_factor(scaling: dict[str, Any] | None, max_position: int) -> float:
    """The factor YaRN and LongRoPE multiply cos and sin by (1.0 for the others)."""
    kind = (scaling or {}).get("rope_type")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_position)
    if kind == "longrope":
        old_ctx = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


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
                 scaling: dict[str, Any] | None = None, rotary_dim: int | None = None):
        """rotary_dim: channels rotated per head (the leading ones); None: all of head_dim."""
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        if scaling is not None and scaling.get("rope_type") in ("yarn", "longrope"):
            scaling = {**scaling, "_factor": _yarn_factor(scaling, max_position)}
        self._args = (self.rotary_dim, max_position, theta, scaling)
        if torch.empty(()).device.type == "meta":  # built on the meta device: materialize()
            # fills the tables (computing them here would run meta decompositions, which
            # import torch._dynamo: seconds of every start-up); the frequencies are checked
            # now, on the CPU, so that an unsupported rope type fails before any weight loads
            if not (scaling and scaling.get("rope_type") == "longrope"):
                with torch.device("cpu"):
                    _inv_freq(self.rotary_dim, theta, scaling)
            cos = sin = torch.empty(max_position, self.rotary_dim // 2)
        else:
            cos, sin = self._table(None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _table(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        dim, max_position, theta, scaling = self._args
        positions = torch.arange(max_position, dtype=torch.float64, device=device)
        if scaling is not None and scaling.get("rope_type") == "longrope":
            freqs = _longrope_freqs(positions, dim, theta, scaling)
        else:
            freqs = torch.outer(positions, _inv_freq(dim, theta, scaling).to(positions.device))
        factor = _attention_factor(scaling, max_position)
        cos, sin = (freqs.cos() * factor).float(), (freqs.sin() * factor).float()
        return (cos, sin) if device is None else (cos.to(device), sin.to(device))

    def materialize(self, device) -> None:
        """Recompute the tables after the module was built on the meta device."""
        self.cos, self.sin = self._table(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T]; q: [T, H, D]; k: [T, K, D] -> rotated (q, k).

        On the CPU in float32, q and k are rotated in place (they are fresh projections)."""
        if self.rotary_dim != q.shape[-1]:
            return self._partial(positions, q, k)
        ops = fused_ops(q)
        if (ops is not None and k.dtype == q.dtype and q.stride(-1) == 1 and k.stride(-1) == 1
                and positions.dtype == torch.long and positions.is_contiguous()):
            ops.rotary_(q, k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


    def _partial(self, positions, q, k):
        rd = self.rotary_dim
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        q = torch.cat((_rotate(q[..., :rd], cos, sin), q[..., rd:]), dim=-1)
        k = torch.cat((_rotate(k[..., :rd], cos, sin), k[..., rd:]), dim=-1)
        return q, k


def _longrope_freqs(positions: torch.Tensor, dim: int, theta: float,
                    s: dict[str, Any]) -> torch.Tensor:
    """[P, dim/2] angles: short factors below the original context, long ones from it."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    short = base / torch.tensor(s["short_factor"], dtype=torch.float64)
    long = base / torch.tensor(s["long_factor"], dtype=torch.float64)
    is_long = (positions >= float(s["original_max_position_embeddings"]))[:, None]
    return torch.where(is_long, torch.outer(positions, long), torch.outer(positions, short))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
