"""RowPartsLinear: one fused linear (q/k/v, gate/up) whose row parts are separate layers.

Why: a GGUF file stores q, k and v (gate and up) as separate tensors, each of its own type --
a Q4_K_M file keeps v in Q6_K beside q and k in Q4_K -- while the model fuses them into one
matrix. Requantizing the fused rows into one type would change the weights; this keeps each
part as its method builds it, and computes the fused output as the parts' outputs side by side.

The C++ decode stack (`decode_entry()`) runs each part into its columns of the output, the
parts' K-quant matrices on one rounding of x to q8_K; a part without a stack form keeps the
whole layer (and model) eager.

Never: mixes parts' codes, or runs parts that disagree on in_features.
"""

from __future__ import annotations

import torch
from torch import nn


class RowPartsLinear(nn.Module):
    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("parts must be one or more layers with the same in_features")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def decode_entry(self):
        """Its form in the C++ decode stack (quant/decode_entry.py): its parts', in order."""
        from servelm.quant.decode_entry import KIND_PARTS, decode_entry, holding_entry

        return holding_entry(KIND_PARTS, self, [decode_entry(p) for p in self.parts])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() if hasattr(p, "dequantize") else p.weight.float()
                          for p in self.parts], dim=0)

    @property
    def num_weight_bytes(self) -> int:
        return sum(p.num_weight_bytes if hasattr(p, "num_weight_bytes")
                   else p.weight.numel() * p.weight.element_size() for p in self.parts)
