"""AmxLinear: a bfloat16 linear layer on servelm's AMX tile GEMM (cpu_kernels/amx_gemm.cpp).

The weight [N, K] is laid out once, at load, as the tiles read it: blocks of 16 output
columns by 32 inputs, each 16 pairs x 16 columns x 2 ([NB, KB, 16, 32], zero padded past N
and K), so that a call streams it front to back. The bias is kept in float32 and added before
the one rounding of each output to bfloat16.

`amx_usable()` says whether this machine runs it: the kernels built with AMX, the probe saw
AMX-BF16 run here (servelm/cpu_kernels/isa.py; a flag is not proof), and the kernel granted
this process the tile state. Never: chooses for a model; the engine build does
(servelm/engine_builder.py, `--cpu-kernels gemm=...`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bfloat16 -> [NB, KB, 16, 32]: tile (nb, kb)[p][2n + j] = W[16 nb + n][32 kb + 2p + j]."""
    n, k = weight.shape
    nb, kb = -(-n // 16), -(-k // 32)
    w = torch.zeros(nb * 16, kb * 32, dtype=torch.bfloat16)
    w[:n, :k] = weight.detach().to(torch.bfloat16)
    return w.view(nb, 16, kb, 16, 2).permute(0, 2, 3, 1, 4).contiguous().view(nb, kb, 16, 32)


def unpack_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_weight's inverse: the [N, K] weight."""
    nb, kb = packed.shape[:2]
    w = packed.view(nb, kb, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 32)
    return w[:n, :k].contiguous()


@functools.lru_cache(maxsize=1)
def amx_usable() -> bool:
    """Whether AmxLinear runs here (see the module's docstring); asks for the tile state."""
    from servelm import cpu_kernels
    from servelm.cpu_kernels import isa

    try:
        ops = cpu_kernels.load()
    except Exception:  # noqa: BLE001 - no kernels, no AMX path
        return False
    return bool(ops.amx_linear_built()) and isa.usable("amx_bf16") and isa.request_amx()


class AmxLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", pack_weight(weight))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    op = "amx_linear"  # the servelm_cpu op forward calls (DotLinear: dot_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(self.op, x, self.out_features)

    def _call(self, op: str, x: torch.Tensor, width: int) -> torch.Tensor:
        """servelm_cpu.<op> on x's rows (contiguous ones), shaped back with `width` outputs."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = getattr(torch.ops.servelm_cpu, op)(x2, self.packed_weight, self.bias,
                                               self.out_features)
        return y.view(*shape[:-1], width)

    def decode_entry(self):
        """Its form in the C++ decode stack (quant/decode_entry.py): its float32 bias."""
        from servelm.quant.decode_entry import KIND_AMX, KIND_DOT, plain_entry

        return plain_entry(KIND_AMX if self.op == "amx_linear" else KIND_DOT, self,
                           self.packed_weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The plain weight [N, K] (exact: the packing only moves values)."""
        return unpack_weight(self.packed_weight, self.out_features, self.in_features)
