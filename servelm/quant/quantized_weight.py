"""QuantizedWeight: a linear layer's weight as codes and scales, before any layer is built.

Owns: the two code formats servelm's weight-only layers are built from, and how they split
and fuse by rows (q/k/v and gate/up are fused row-wise in the model, and stored as separate
HF tensors in a checkpoint):

    int8   q[out, in] int8 in [-127, 127], scale[out]               w = q * scale
           or, with group_size > 0, scale[out, G] float32 (GGUF's Q8_0: group 32)
    int4   q[out, in] uint8 in 0..15, scale, zero [out, G]          w = (q - 8) * scale + zero
           (G = ceil(in / group_size); tinygemm's convention, see int4_linear.py)

and the int4 codes' on-disk packing (two codes a byte, `pack_int4` / `unpack_int4`).
With `perm` (GPTQ act-order), the codes' columns are the layer's inputs in that order:
column i of q multiplies x[perm[i]] (servelm/quant/permuted_linear.py gathers x first).

Never: builds layers (a QuantMethod does) or reads files
(servelm/loader/quantized_checkpoint.py does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FORMATS = ("int8", "int4")


class QuantizedWeight(NamedTuple):
    format: str  # "int8" | "int4"
    q: torch.Tensor  # codes [out, in]: int8 (int8) or uint8 0..15 (int4)
    scale: torch.Tensor  # [out] (int8), [out, G] (int4, grouped int8)
    zero: torch.Tensor | None  # [out, G] (int4) or None
    group_size: int  # int4; grouped int8; 0 for per-row int8
    perm: torch.Tensor | None = None  # [in] int64: the input column of each code column

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def type_name(self) -> str:
        """One name per format, group size and input order: shards fuse only when these
        agree (shards with different act-order permutations do not)."""
        if self.format == "int8":
            name = f"int8-g{self.group_size}" if self.group_size else "int8"
        else:
            name = f"int4-g{self.group_size}"
        if self.perm is None:
            return name
        import hashlib

        digest = hashlib.sha1(self.perm.to(torch.int64).numpy().tobytes()).hexdigest()[:12]
        return f"{name}-perm{digest}"

    def to(self, *args, **kwargs) -> QuantizedWeight:
        return self  # dtype casts apply to float tensors only; codes stay codes

    def rows(self, start: int, length: int) -> QuantizedWeight:
        zero = None if self.zero is None else self.zero[start:start + length]
        return QuantizedWeight(self.format, self.q[start:start + length],
                               self.scale[start:start + length], zero, self.group_size,
                               self.perm)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], columns in the layer's input order."""
        if self.perm is not None:
            w = self._replace(perm=None).dequantize()
            return w[:, torch.argsort(self.perm)].contiguous()
        if self.format == "int8" and not self.group_size:
            return self.q.float() * self.scale.float()[:, None]
        out, k = self.shape
        if self.format == "int8":
            return self.q.float() * self.scale.float().repeat_interleave(
                self.group_size, dim=1)[:, :k]
        g = self.group_size
        scale = self.scale.float().repeat_interleave(g, dim=1)[:, :k]
        zero = self.zero.float().repeat_interleave(g, dim=1)[:, :k]
        return (self.q.float() - 8) * scale + zero

    def validate(self) -> QuantizedWeight:
        """Raise ValueError unless the parts fit together; returns self."""
        if self.format not in FORMATS:
            raise ValueError(f"quantized weight format must be one of {FORMATS}, "
                             f"got {self.format!r}")
        if self.q.dim() != 2:
            raise ValueError(f"codes must be 2-D [out, in], got {tuple(self.q.shape)}")
        out, k = self.shape
        if self.format == "int8":
            want_q = torch.int8
            want_scale = (out, -(-k // self.group_size)) if self.group_size > 0 else (out,)
            if self.group_size < 0:
                raise ValueError(f"int8 group_size must be >= 0, got {self.group_size}")
        else:
            want_scale, want_q = (out, -(-k // max(self.group_size, 1))), torch.uint8
            if self.group_size <= 0:
                raise ValueError(f"int4 group_size must be positive, got {self.group_size}")
            if self.zero is None or tuple(self.zero.shape) != want_scale:
                raise ValueError(f"int4 zeros must be {list(want_scale)}, got "
                                 f"{None if self.zero is None else list(self.zero.shape)}")
        if self.q.dtype != want_q:
            raise ValueError(f"{self.format} codes must be {want_q}, got {self.q.dtype}")
        if tuple(self.scale.shape) != want_scale:
            raise ValueError(f"{self.format} scales must be {list(want_scale)}, got "
                             f"{list(self.scale.shape)}")
        if self.perm is not None and not torch.equal(
                torch.sort(self.perm.to(torch.int64)).values, torch.arange(k)):
            raise ValueError(f"perm must be a permutation of the {k} input columns")
        return self


def cat_quantized_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Every part is per row (a scale per row, groups along a row), so fusing is stacking."""
    kinds = {p.type_name for p in parts}
    if len(kinds) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"cannot fuse quantized shards of types {sorted(kinds)} / shapes "
                         f"{[p.shape for p in parts]}")
    first = parts[0]
    zero = None if first.zero is None else torch.cat([p.zero for p in parts])
    return QuantizedWeight(first.format, torch.cat([p.q for p in parts]),
                           torch.cat([p.scale for p in parts]), zero, first.group_size,
                           first.perm)  # one perm: type_name says they agree


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] (in even) -> [out, in / 2]: column 2j in the low nibble of byte
    j, column 2j + 1 in the high nibble."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [out, in / 2] uint8 -> [out, in] codes 0..15."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], -1).contiguous()
