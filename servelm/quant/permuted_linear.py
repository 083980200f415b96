"""PermutedLinear: a quantized layer whose code columns are its inputs in another order.

GPTQ's act-order (`desc_act`) quantizes the input columns in the order of the Hessian's
diagonal, so a group of scales covers columns scattered over the row (`g_idx`). Sorting the
columns by group makes every group contiguous, as servelm's int4 / int8 kernels take them;
the layer then multiplies the codes by the activations gathered into that order:

    y = codes @ x[:, perm]        perm[i]: the input column of code column i

One gather of T x in values a call, exact (the same products, summed in the kernel's order).
The C++ decode stack takes it as its inner layer after the same gather (`decode_entry()`).

Never: reorders codes (the reader did, once at load: servelm/quant/community_codes.py).
"""

from __future__ import annotations

import torch

from servelm.quant.quantized_linear import QuantizedLinear


class PermutedLinear(QuantizedLinear):
    def __init__(self, inner: QuantizedLinear, perm: torch.Tensor):
        if tuple(perm.shape) != (inner.in_features,):
            raise ValueError(f"perm must have the layer's {inner.in_features} input columns, "
                             f"got {tuple(perm.shape)}")
        super().__init__(inner.in_features, inner.out_features, None, inner.compute_dtype)
        self.inner = inner  # holds the bias, added after the product
        device = next(inner.buffers()).device  # where the codes are: a GPU layer's too
        self.register_buffer("perm", perm.to(device, torch.int64).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))

    def decode_entry(self):
        """Its form in the C++ decode stack (quant/decode_entry.py): perm, then its inner's."""
        from servelm.quant.decode_entry import KIND_PERMUTED, decode_entry, holding_entry

        return holding_entry(KIND_PERMUTED, self, [decode_entry(self.inner)], self.perm)

    def dequantize(self) -> torch.Tensor:
        return self.inner.dequantize()[:, torch.argsort(self.perm)].contiguous()

    @property
    def num_weight_bytes(self) -> int:
        return self.inner.num_weight_bytes + self.perm.numel() * self.perm.element_size()
