"""`--quantization gguf-mixed` (servelm/quant/mixed_linear.py): a GGUF file's codes for steps
of a few rows, their bfloat16 values above. Each form gives exactly what its own layer gives;
--dtype auto keeps bfloat16 for it on a CPU with bfloat16 math; the decode stack takes the
few-row form for a one-sequence step and the bfloat16 one for a batch, bit-equal to the eager
model in both."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from servelm.cpu_kernels import isa
from servelm.layers.amx_linear import amx_usable
from servelm.layers.dot_linear import dot_usable
from servelm.llm import LLM
from servelm.protocol import SamplingParams
from servelm.quant.int4_linear import Int4Linear
from servelm.quant.mixed_linear import MixedLinear

needs_bf16 = pytest.mark.skipif(not isa.has_bf16_math(),
                                reason="the CPU has no usable bfloat16 dot products")


def test_rows_choose_the_form():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 64), dtype=torch.uint8, generator=g)
    scale = torch.rand(48, 2, generator=g) * 0.01
    small = Int4Linear(q, scale, -8 * scale, 32, None, torch.bfloat16, kernel="cpu")
    full = nn.Linear(64, 48, bias=False).to(torch.bfloat16).requires_grad_(False)
    full.weight.copy_(small.dequantize())
    layer = MixedLinear(full, small, max_rows=4)
    for rows in (1, 3, 4):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        assert torch.equal(layer(x), small(x))
    for rows in (5, 9):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        assert torch.equal(layer(x), full(x))
    x = torch.randn(2, 3, 64, generator=g).bfloat16()  # 6 rows in all: the full form
    assert torch.equal(layer(x), full(x))
    with pytest.raises(ValueError, match="max_rows"):
        MixedLinear(full, small, max_rows=0)


def _outputs(llm, prompts):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    return [(o.outputs[0].token_ids, [(lp.token_id, lp.logprob, lp.top)
                                      for lp in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


@needs_bf16
def test_the_default_model_mixed_in_bfloat16_and_the_stack_matches_eager(
        default_model_path, caplog):
    caplog.set_level("INFO", logger="servelm.dtype_choice")
    stack_llm = LLM("smollm2-135m-instruct", quantization="gguf-mixed",
                    cpu_kernels="decode=kernel")
    assert "dtype auto -> bfloat16" in caplog.text
    model = stack_llm.engine.runner.model
    layer = model.layers[0]
    assert type(layer.self_attn.qkv_proj) is MixedLinear
    assert type(layer.self_attn.qkv_proj.small) is Int4Linear
    # packed as usual: servelm's avx512_bf16 GEMM where it runs (and AMX does not), else oneDNN
    dots = dot_usable() and not amx_usable()
    assert type(layer.self_attn.qkv_proj.full).__name__ == ("DotLinear" if dots
                                                            else "PackedLinear")
    eager_llm = LLM("smollm2-135m-instruct", quantization="gguf-mixed",
                    cpu_kernels="decode=torch")
    one = [[1, 504, 3458, 282, 4649, 30]]
    batch = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(8)]
    stack = stack_llm.engine.runner.cpu_stack
    assert _outputs(stack_llm, one) == _outputs(eager_llm, one)
    assert list(stack._stacks) == ["small"]  # a one-row step: the codes
    assert _outputs(stack_llm, batch) == _outputs(eager_llm, batch)
    assert "full" in stack._stacks  # eight rows a step: bfloat16
