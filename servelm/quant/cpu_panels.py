"""The panel layout of servelm's C++ int4/int8 matmuls (servelm/cpu_kernels/quant_gemm.cpp).

Weight rows go in panels of 16 (the last one padded with zero rows), interleaved along K so
that one column of a panel is one 16-lane vector:

    int4: codes [P, K/2, 16] uint8, codes[p, k/2, j] = q[16p+j, k] | q[16p+j, k+1] << 4
          sz    [P, G, 2, 16] (scale, zero), w = (q - 8) * scale + zero
    int8: codes [P, K, 16] int8, scale [16P] (per row) or [P, G, 16] (per group) float32,
          w = q * scale

Padded rows have scale 0 and zero 0, so they are 0 whatever their codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LANES = 16


def num_panels(n: int) -> int:
    return -(-n // LANES)


def pack_int4_panels(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     sz_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] codes 0..15 (K % 32 == 0), scale / zero [N, G] -> (codes, sz)."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"int4 panels need in_features divisible by 32, got {k}")
    p = num_panels(n)
    pad = p * LANES - n
    qp = F.pad(q.to(torch.uint8), (0, 0, 0, pad), value=8).view(p, LANES, k // 2, 2)
    codes = (qp[..., 0] | (qp[..., 1] << 4)).permute(0, 2, 1).contiguous()
    sz = torch.stack([F.pad(scale.to(sz_dtype), (0, 0, 0, pad)),
                      F.pad(zero.to(sz_dtype), (0, 0, 0, pad))], dim=0)  # [2, N', G]
    sz = sz.view(2, p, LANES, -1).permute(1, 3, 0, 2).contiguous()  # [P, G, 2, 16]
    return codes, sz


def unpack_int4_panels(codes: torch.Tensor, sz: torch.Tensor, n: int, group: int
                       ) -> torch.Tensor:
    """The float32 weight [N, K] the panels hold."""
    p, half_k, _ = codes.shape
    c = codes.permute(0, 2, 1)  # [P, 16, K/2]
    q = torch.stack([c & 15, c >> 4], dim=-1).reshape(p * LANES, 2 * half_k).float()
    s = sz.float().permute(2, 0, 3, 1).reshape(2, p * LANES, -1)  # [2, N', G]
    scale = s[0].repeat_interleave(group, dim=1)[:, : 2 * half_k]
    zero = s[1].repeat_interleave(group, dim=1)[:, : 2 * half_k]
    return ((q - 8) * scale + zero)[:n].contiguous()


def pack_int8_panels(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scale [N] or [N, G] -> (codes [P, K, 16] int8, scale [16P] or
    [P, G, 16] float32)."""
    n, k = q.shape
    p = num_panels(n)
    pad = p * LANES - n
    codes = F.pad(q.to(torch.int8), (0, 0, 0, pad)).view(p, LANES, k).permute(0, 2, 1)
    if scale.dim() == 1:
        return codes.contiguous(), F.pad(scale.float(), (0, pad)).contiguous()
    groups = F.pad(scale.float(), (0, 0, 0, pad)).view(p, LANES, -1).permute(0, 2, 1)
    return codes.contiguous(), groups.contiguous()


def unpack_int8_panels(codes: torch.Tensor, n: int) -> torch.Tensor:
    """The int8 codes [N, K] the panels hold."""
    p, k, _ = codes.shape
    return codes.permute(0, 2, 1).reshape(p * LANES, k)[:n].contiguous()


PART = "quant"  # of CpuKernelChoice: `--cpu-kernels quant=MODE`


def panel_ops(required: bool = False):
    """torch.ops.servelm_cpu for the panel kernels, or None (`--cpu-kernels quant=torch`, or a
    failed build in mode 'auto': the layers then take aten's bf16 ops). required: raise
    instead of returning None (a layer built with kernel='cpu'). The layers are built by the
    engine build, after it set the process's choice."""
    from servelm import cpu_kernels

    if required:
        if cpu_kernels.mode(PART) == "torch":
            raise ValueError("kernel='cpu' needs servelm's C++ kernels, but the engine option "
                             f"says cpu_kernels {PART}=torch")
        return cpu_kernels.load()
    return cpu_kernels.ops_for_mode(PART)
