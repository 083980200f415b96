"""W8A8 fp8 (servelm/quant/fp8_linear.py): the quantize/scale arithmetic on the CPU against
float math, torch._scaled_mm called as the GPU path calls it (torch's CPU implementation of
the op checks layouts, scale shapes and padding: not a serving path) against the
dequantize-and-matmul reference, the refusal off sm89+ GPUs, and -- on a GPU that has fp8
tensor cores -- the layer and a tiny model against float.
"""

import pytest
import torch

from servelm.protocol import InvalidParameterError
from servelm.quant import get_quant_method
from servelm.kernels.fp8_format import FP8_MAX
from servelm.quant.fp8_linear import (
    Fp8Linear,
    fp8_linear_ref,
    fp8_support_error,
    quantize_fp8_per_channel,
    quantize_fp8_per_token,
)

GEN = torch.Generator().manual_seed(0)
HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _weight(n, k):
    w = torch.randn(n, k, generator=GEN) * 0.05
    w[::7, ::13] *= 10  # outliers, as real checkpoints have
    return w


def test_per_channel_weight_scales():
    w = _weight(48, 100)
    wq, scale = quantize_fp8_per_channel(w)
    assert wq.dtype == torch.float8_e4m3fn and scale.shape == (48,)
    deq = wq.float() * scale[:, None]
    # each row's largest magnitude maps onto 448, exactly representable
    assert torch.equal(wq.float().abs().amax(1), torch.full((48,), FP8_MAX))
    # e4m3: relative error <= 2^-4 for normal values, absolute <= 2^-10 * scale below 2^-6
    bound = torch.maximum(w.abs() * 2**-4, 2**-10 * scale[:, None]) + 1e-12
    assert ((deq - w).abs() <= bound).all()
    zero_row = quantize_fp8_per_channel(torch.zeros(2, 8))
    assert torch.isfinite(zero_row[1]).all() and (zero_row[0].float() == 0).all()


def test_per_token_activation_scales_follow_each_token():
    x = torch.randn(5, 64, generator=GEN)
    x[2] *= 1000  # an outlier token does not flatten the others
    xq, scale = quantize_fp8_per_token(x)
    assert scale.shape == (5, 1)
    torch.testing.assert_close(scale[:, 0], x.abs().amax(1) / FP8_MAX)
    rel = ((xq.float() * scale - x).abs() / x.abs().clamp_min(1e-6))
    normal = x.abs() / scale >= 2**-6
    assert rel[normal].max() <= 2**-4 + 1e-6
    assert normal[0].float().mean() > 0.9  # token 0 keeps its precision


@pytest.mark.parametrize("shape", [(1, 48, 100), (33, 80, 64), (7, 576, 576)])
def test_reference_is_within_fp8_error_of_float(shape):
    m, n, k = shape
    x, w = torch.randn(m, k, generator=GEN), _weight(n, k)
    wq, w_scale = quantize_fp8_per_channel(w)
    ref = fp8_linear_ref(x, wq, w_scale)
    magnitude = x.abs() @ w.abs().t()
    # both operands within 2^-4 (relative): the product within ~2^-3 of |x| @ |w|
    assert ((ref - x @ w.t()).abs() <= 2**-3 * magnitude + 1e-5).all()
    typical = ((ref - x @ w.t()).abs() / magnitude).mean()
    assert typical < 2**-6  # errors mostly cancel: ~1% of |x| @ |w|


@pytest.mark.parametrize("shape", [(1, 48, 100), (33, 80, 64), (5, 30, 17)])
def test_scaled_mm_call_matches_reference(shape):
    """Fp8Linear.forward -- the GPU path's exact call sequence (per-token quantization,
    padding to multiples of 16, torch._scaled_mm with [M, 1] / [1, N] scales) -- run by torch's
    CPU _scaled_mm, against the dequantize-and-matmul reference."""
    m, n, k = shape
    x, w, bias = torch.randn(m, k, generator=GEN), _weight(n, k), torch.randn(n, generator=GEN)
    layer = Fp8Linear.from_float(w, bias)
    assert layer.weight_t.shape == (-(-k // 16) * 16, -(-n // 16) * 16)
    assert layer.weight_t.stride(0) == 1  # column-major, as _scaled_mm wants its second operand
    y = layer(x)
    ref = fp8_linear_ref(x, *quantize_fp8_per_channel(w), bias)
    assert y.shape == (m, n) and y.dtype == x.dtype
    # the GEMM returns bf16: one rounding of the product (before the bias)
    tol = 2**-8 * (x.abs() @ layer.dequantize().abs().t()) + 2**-8 * bias.abs() + 1e-5
    assert ((y - ref).abs() <= tol).all()
    torch.testing.assert_close(layer.dequantize(), quantize_fp8_per_channel(w)[0].float()
                               * quantize_fp8_per_channel(w)[1][:, None])
    assert layer.num_weight_bytes == layer.weight_t.numel() + 4 * layer.w_scale_row.numel()


def test_refused_off_fp8_gpus():
    cpu = fp8_support_error(torch.device("cpu"))
    assert "quantization 'fp8'" in cpu and "cpu" in cpu
    ampere = fp8_support_error(torch.device("cuda"), (8, 0))
    assert "8.9" in ampere and "8.0" in ampere
    assert fp8_support_error(torch.device("cuda"), (8, 9)) is None
    assert fp8_support_error(torch.device("cuda"), (9, 0)) is None
    method = get_quant_method("fp8")
    with pytest.raises(InvalidParameterError, match="needs a CUDA GPU") as e:
        method.check_device(torch.device("cpu"))
    assert e.value.param == "quantization"
    with pytest.raises(InvalidParameterError) as e:
        method.from_float(_weight(16, 16), None)  # a CPU weight: refused, not quantized
    assert e.value.param == "quantization"
    assert method.lm_head_method() is None  # the head stays float


def test_engine_with_fp8_on_cpu_is_refused(tiny_hf, tiny_engine):
    with pytest.raises(InvalidParameterError, match="quantization 'fp8'") as e:
        tiny_engine(tiny_hf("llama"), quantization="fp8")
    assert e.value.param == "quantization"


def test_fp8_is_not_written_as_a_checkpoint():
    with pytest.raises(InvalidParameterError, match="--quantization fp8") as e:
        get_quant_method("fp8").quantize(_weight(16, 16))
    assert e.value.param == "method"


@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with compute capability >= 8.9")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_layer_on_gpu_matches_reference(dtype):
    x = torch.randn(33, 576, generator=GEN).to(dtype)
    w, bias = _weight(960, 576), torch.randn(960, generator=GEN)
    layer = Fp8Linear.from_float(w.cuda(), bias.cuda().to(dtype))
    y = layer(x.cuda()).cpu()
    ref = fp8_linear_ref(x.float(), *quantize_fp8_per_channel(w), bias.to(dtype).float())
    tol = 2**-7 * (x.float().abs() @ w.abs().t() + bias.abs()) + 1e-3
    assert ((y.float() - ref).abs() <= tol).all()


@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with compute capability >= 8.9")
def test_fp8_tiny_model_on_gpu_agrees_with_bf16(tiny_hf, tiny_engine):
    from servelm.llm import LLM
    from servelm.protocol import SamplingParams

    hf = tiny_hf("llama")
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 250, 11, 42], [1, 2, 3, 4], [300, 200, 100, 50, 25]]
    outs = {}
    for q in (None, "fp8"):
        engine = tiny_engine(hf, device="cuda", dtype="bfloat16", attention_backend="triton",
                             quantization=q)
        outs[q] = [o.outputs[0].token_ids
                   for o in LLM(engine=engine).generate(prompts, greedy, use_tqdm=False)]
    layer = engine.runner.model.layers[0].mlp.down_proj
    assert isinstance(layer, Fp8Linear)
    first = [a[0] == b[0] for a, b in zip(outs[None], outs["fp8"])]
    assert sum(first) >= 2, outs  # free-running sequences may part later; the start agrees
