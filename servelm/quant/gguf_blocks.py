"""GGUFBlocks: a GGUF tensor's raw quantized blocks, and their decoding into codes and scales.

Owns: the byte layout of ggml's Q8_0, Q4_0, Q4_1 and Q5_0 blocks (32 weights each, along a
row):

    Q8_0: d f16 | q int8 x32                      w = q * d               34 bytes
    Q4_0: d f16 | 16 bytes of nibbles             w = (q - 8) * d         18 bytes
    Q4_1: d f16 | m f16 | 16 bytes of nibbles     w = q * d + m           20 bytes
    Q5_0: d f16 | qh u32 | 16 bytes of nibbles    w = (q - 16) * d        22 bytes
    nibbles: byte j holds weight j (low 4 bits) and weight j + 16 (high 4 bits); Q5_0's
    fifth bit of weight j is bit j of qh

and which K-quants (256-weight super-blocks, KQUANT_BYTES) are kept as the file's bytes
(servelm/quant/kquant_linear.py decodes those; `dequantize` here is gguf-py's own).

Never: reads files (the loader hands the bytes over) or turns codes into floats to quantize
them again: codes and scales are taken as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22}
KQUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # per 256 weights


def is_kept_type(type_name: str) -> bool:
    """Whether a GGUF tensor of this type is handed over as its blocks (not float values)."""
    return type_name in BLOCK_BYTES or type_name in KQUANT_BYTES


class GGUFBlocks(NamedTuple):
    """One 2-D GGUF tensor kept quantized: data[rows, blocks_per_row * block_bytes] uint8."""

    type_name: str  # a BLOCK_BYTES or KQUANT_BYTES type
    data: torch.Tensor
    shape: tuple[int, int]  # (out, in), like the float weight

    def to(self, *args, **kwargs) -> GGUFBlocks:
        return self  # dtype casts apply to float tensors only; blocks stay bytes

    def rows(self, start: int, length: int) -> GGUFBlocks:
        return GGUFBlocks(self.type_name, self.data[start:start + length],
                          (length, self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], the same values as gguf-py's `dequantize`."""
        if self.type_name in KQUANT_BYTES:
            return _gguf_py_dequantize(self)
        if self.type_name in ("Q8_0", "Q5_0"):
            q, d = decode_q8_0(self) if self.type_name == "Q8_0" else decode_q5_0(self)
            return (q.float().view(*d.shape, BLOCK) * d[..., None]).view(self.shape)
        q, d, m = _q4_parts(self)
        n, g = d.shape
        q = q.float().view(n, g, BLOCK)
        if self.type_name == "Q4_0":
            w = (q - 8) * d[..., None]
        else:  # gguf-py's own order of operations, so the floats agree bit for bit
            w = q * d[..., None] + m[..., None]
        return w.view(self.shape)


def cat_rows(parts: list[GGUFBlocks]) -> GGUFBlocks:
    """Blocks run along rows, so fusing q/k/v (or gate/up) is stacking their rows."""
    kinds = {p.type_name for p in parts}
    if len(kinds) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"cannot fuse GGUF shards of types {sorted(kinds)} / shapes "
                         f"{[p.shape for p in parts]}")
    data = torch.cat([p.data for p in parts], dim=0)
    return GGUFBlocks(parts[0].type_name, data, (data.shape[0], parts[0].shape[1]))


def _blocks(b: GGUFBlocks) -> torch.Tensor:
    size = BLOCK_BYTES.get(b.type_name)
    if size is None:
        raise ValueError(f"GGUF type {b.type_name} is not supported natively; "
                         f"supported: {sorted(BLOCK_BYTES)}")
    rows, cols = b.shape
    if cols % BLOCK or b.data.shape != (rows, cols // BLOCK * size):
        raise ValueError(f"{b.type_name} data {tuple(b.data.shape)} does not fit shape {b.shape}")
    return b.data.contiguous().view(rows, cols // BLOCK, size)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian -> [...] float32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def decode_q8_0(b: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q[out, in] int8, d[out, in / 32] float32)."""
    blocks = _blocks(b)
    d = _f16(blocks[..., 0:2])
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(b.shape)
    return q, d


def decode_q5_0(b: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q - 16 [out, in] int8 in -16..15, d[out, in / 32] float32): Q8_0's form, exactly."""
    blocks = _blocks(b)
    d = _f16(blocks[..., 0:2])
    high = blocks[..., 2:6].contiguous().view(torch.int32)  # [out, G, 1] little-endian
    bits = (high >> torch.arange(BLOCK, dtype=torch.int32)) & 1  # [out, G, 32]
    nibbles = blocks[..., 6:]
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.int32)
    q = (low | (bits << 4)) - 16
    return q.to(torch.int8).reshape(b.shape), d


def _gguf_py_dequantize(b: GGUFBlocks) -> torch.Tensor:
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, cols = b.shape
    if cols % 256 or tuple(b.data.shape) != (rows, cols // 256 * KQUANT_BYTES[b.type_name]):
        raise ValueError(f"{b.type_name} data {tuple(b.data.shape)} does not fit shape {b.shape}")
    w = dequantize(b.data.contiguous().numpy(), GGMLQuantizationType[b.type_name])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).view(rows, cols)


def _q4_parts(b: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q[out, in] uint8 0..15, d, m [out, in / 32]); m = -8 d for Q4_0."""
    blocks = _blocks(b)
    d = _f16(blocks[..., 0:2])
    if b.type_name == "Q4_1":
        m, nibbles = _f16(blocks[..., 2:4]), blocks[..., 4:]
    elif b.type_name == "Q4_0":
        m, nibbles = -8.0 * d, blocks[..., 2:]
    else:
        raise ValueError(f"Q4_0/Q4_1 blocks expected, got {b.type_name}")
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # weights 0..15, then 16..31
    return q.reshape(b.shape), d, m


def decode_q4(b: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 -> (q[out, in] uint8 0..15, scale, zero [out, in / 32]) in Int4Linear's
    convention w = (q - 8) * scale + zero: scale = d, zero = m + 8 d (0 for Q4_0)."""
    q, d, m = _q4_parts(b)
    zero = torch.zeros_like(d) if b.type_name == "Q4_0" else m + 8.0 * d
    return q, d, zero
