"""Int8Head: an int8 lm_head whose logits near each row's maximum are exact in float32.

With servelm's C++ int8 GEMM (`kernel="cpu"`, the default where it builds) every logit is
float32 math on the int8 weight already, and the head is an Int8Linear (with int8 activations,
`--quant-activations int8` where the CPU has avx512_vnni and the head's method asks for them:
integer math on the int8 weight and the hidden state rounded per 32 values). The rest of this note
is about aten's op (`kernel="aten"`, the fallback).

Why: aten's fast CPU op returns bf16, and bf16 logits are spaced 0.06-0.125 apart around 10-20,
so a greedy choice between two tokens 0.08 nats apart (SmolLM2 has such cases on plain
prompts: "What is the capital of France?" starts "The" or "L'") becomes a coin toss. The
op's result finds the candidates, which are then recomputed from the int8 rows in float32:

    coarse[t, v] = op(bf16(x_t), q, scale)                   bf16 in, bf16 out
    |coarse - exact| <= 2^-8 (||x_t|| ||w_v|| + |coarse[t, v]|) <= E[t]
        (x's rounding, by Cauchy-Schwarz, and the result's, each 2^-9, doubled for slack;
         E[t] takes the largest row norm and the largest |coarse[t, :]|)
    recompute where coarse >= max(coarse[t, :]) - 2 E[t]      (all that can be the argmax)

so greedy tokens, and the logits of every token that could be the argmax, are float32 math on
the int8 weight (a handful of candidates per token on SmolLM2); the rest keep bf16 rounding
(2^-8 relative at worst). One pass over the logits: ~0.25 ms on top of the op's ~4.4 ms.
"""

from __future__ import annotations

import torch

from servelm.quant.int8_linear import Int8Linear


class Int8Head(Int8Linear):
    def __init__(self, q, scale, bias=None, compute_dtype=torch.bfloat16, kernel=None,
                 group_size=0, activations="float"):
        super().__init__(q, scale, bias, compute_dtype, kernel, group_size, activations)
        # max_v ||w_v||, for the bound below; the C++ kernel's logits need none (exact already)
        self.max_row_norm = (None if self.kernel == "cpu"
                             else self.dequantize().norm(dim=1).max().item())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        coarse = super().forward(x)
        if (self.kernel == "cpu" or self.compute_dtype == torch.float32
                or x.device.type != "cpu"):
            return coarse
        y = coarse.float()
        top = y.amax(dim=-1, keepdim=True)
        bound = 2.0**-8 * (x.float().norm(dim=-1, keepdim=True) * self.max_row_norm
                           + y.abs().amax(dim=-1, keepdim=True))
        t, v = torch.nonzero(y >= top - 2 * bound, as_tuple=True)
        rows = self.q[v].float() * self.scale[v].float()[:, None]  # [P, in]
        exact = (x[t].float() * rows).sum(-1)
        if self.bias is not None:
            exact = exact + self.bias[v].float()
        y[t, v] = exact
        return y.to(x.dtype)
