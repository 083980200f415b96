"""RMSNorm, with the residual add fused into the same pass; GemmaRMSNorm scales by (1 + w)."""

from __future__ import annotations

import torch
from torch import nn

from servelm.layers.fused_cpu import fused_ops


class RMSNorm(nn.Module):
    # deterministic mode on the GPU: the per-row Triton kernel (kernels/batch_invariant.py)
    batch_invariant = False

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        weight = self.scale()
        if self.batch_invariant:
            from servelm.kernels.batch_invariant import bi_rms_norm

            return bi_rms_norm(x, weight, self.eps, residual)
        ops = fused_ops(x)
        if ops is not None and residual is None and x.stride(-1) == 1:
            # One pass instead of ~8 ops; a strided view (q/k norms over heads split from
            # the qkv projection) is copied first: torch's rms_norm of a strided input may
            # sum a row in an order that depends on the shape (deterministic mode).
            return ops.rms_norm(x.contiguous(), weight, self.eps)
        if ops is not None and x.is_contiguous():
            if residual is None:
                return ops.rms_norm(x, weight, self.eps)
            if residual.is_contiguous() and residual.dtype == x.dtype:
                return ops.add_rms_norm(x, residual, weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        out = torch.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return out if residual is None else (out, residual)

    def scale(self) -> torch.Tensor:
        """What the normalised row is multiplied by."""
        return self.weight


class GemmaRMSNorm(RMSNorm):
    """Gemma stores w with the norm computing x_hat * (1 + w); checkpoints keep w."""

    def scale(self) -> torch.Tensor:
        return self.weight + 1.0
