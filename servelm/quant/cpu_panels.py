"""The panel layout of servelm's C++ int4/int8 matmuls (servelm/cpu_kernels/quant_gemm.cpp).

Weight rows go in panels of 16 (the last one padded with zero rows), interleaved along K so
that one column of a panel is one 16-lane vector:

    int4: codes [P, K/2, 16] uint8, codes[p, k/2, j] = q[16p+j, k] | q[16p+j, k+1] << 4
          sz    [P, G, 2, 16] (scale, zero), w = (q - 8) * scale + zero
    int8: codes [P, K, 16] int8, scale [16P] (per row) or [P, G, 16] (per group) float32,
          w = q * scale

Padded rows have scale 0 and zero 0, so they are 0 whatever their codes.

The int8-activation kernels (servelm/cpu_kernels/quant_gemm_a8.cpp, avx512_vnni's vpdpbusd)
take the codes as unsigned bytes, four consecutive columns of a row in one 32-bit lane, so
that one 64-byte vector is 16 rows x 4 columns (K padded to Kp, a multiple of 32):

    int4 (VNNI): codes [P, Kp/8, 16, 4] uint8, byte b of lane j in block i holds
                 q[16p+j, 8i+b] (low nibble) and q[16p+j, 8i+4+b] (high nibble);
                 so [P, G, 2, 16] (scale, offset), w = q * scale + offset (Q4_1's form)
    int8 (VNNI): codes [P, Kp/4, 16, 4] uint8, byte b of lane j in block i = q[16p+j, 4i+b]
                 + 128 (padded columns: code 0 + 128); scales as above
    Their scales are stored in the narrowest float type that holds them exactly
    (`narrowest_exact`: GGUF's float16 d and m stay float16).
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
    q = torch.stack([c & 15, c >> 4], dim=-1).reshape(p * LANES, 2 * half_k)
    return int4_panel_weight(q, sz, n, group)


def int4_panel_weight(q: torch.Tensor, sz: torch.Tensor, n: int, group: int,
                      centred: bool = True) -> torch.Tensor:
    """The float32 weight [N, K] of codes q [>= N, K] (rows of the panels) and sz [P, G, 2, 16]:
    (q - 8) * scale + zero, or with centred=False (the VNNI layout's `so`) q * scale + offset."""
    k = q.shape[1]
    s = sz.float().permute(2, 0, 3, 1).reshape(2, -1, sz.shape[1])  # [2, N', G]
    scale = s[0].repeat_interleave(group, dim=1)[:n, :k]
    zero = s[1].repeat_interleave(group, dim=1)[:n, :k]
    return ((q[:n].float() - (8 if centred else 0)) * scale + zero).contiguous()


def narrowest_exact(t: torch.Tensor) -> torch.Tensor:
    """t in float16 or bfloat16 where that holds every value exactly, else float32."""
    t32 = t.float()
    for dtype in (torch.float16, torch.bfloat16):
        if torch.equal(t32.to(dtype).float(), t32):
            return t32.to(dtype)
    return t32


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


def pack_int4_vnni(q: torch.Tensor) -> torch.Tensor:
    """q [N, Kp] codes 0..15 (Kp % 32 == 0) -> codes [P, Kp/8, 16, 4] uint8 (VNNI layout)."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"int4 VNNI panels need in_features padded to a multiple of 32, got {k}")
    p = num_panels(n)
    qp = F.pad(q.to(torch.uint8), (0, 0, 0, p * LANES - n), value=8).view(p, LANES, k // 8, 2, 4)
    return (qp[:, :, :, 0] | (qp[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()


def unpack_int4_vnni(codes: torch.Tensor, n: int) -> torch.Tensor:
    """The codes q [N, Kp] (0..15) of pack_int4_vnni's layout."""
    p, blocks, _, _ = codes.shape
    c = codes.permute(0, 2, 1, 3)  # [P, 16, Kp/8, 4]
    q = torch.stack([c & 15, c >> 4], dim=3)  # [P, 16, Kp/8, 2, 4]
    return q.reshape(p * LANES, blocks * 8)[:n].contiguous()


def pack_int8_vnni(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 -> codes [P, Kp/4, 16, 4] uint8 (q + 128; Kp = K rounded up to 32)."""
    n, k = q.shape
    p, kp = num_panels(n), -(-k // 32) * 32
    qp = F.pad(q.to(torch.int16), (0, kp - k, 0, p * LANES - n)) + 128
    return qp.to(torch.uint8).view(p, LANES, kp // 4, 4).permute(0, 2, 1, 3).contiguous()


def unpack_int8_vnni(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 codes [N, K] of pack_int8_vnni's layout."""
    p, blocks, _, _ = codes.shape
    q = codes.permute(0, 2, 1, 3).reshape(p * LANES, blocks * 4).to(torch.int16) - 128
    return q[:n, :k].to(torch.int8).contiguous()


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
