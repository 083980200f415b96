"""Triton w8a16 GEMM (int8 weights, one scale per output row) against its torch reference,
and Int8Linear's Triton path against its CPU path on the same codes. Odd shapes: M 1/33,
K and N not multiples of the tiles."""

import pytest
import torch

from servelm.kernels.w8a16_gemm import w8a16_gemm, w8a16_gemm_ref
from servelm.quant.int8_head import Int8Head
from servelm.quant.int8_linear import Int8Linear, quantize_int8_per_channel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 48, 100), (33, 80, 200), (1, 96, 300), (33, 16, 130), (64, 40, 257)]


def _case(m, n, k, dtype, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[::5, ::11] *= 6
    q, scale = quantize_int8_per_channel(w, torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, q, scale, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}N{}K{}".format(*s))
def test_w8a16_matches_reference(shape, dtype):
    m, n, k = shape
    x, q, scale, bias = _case(m, n, k, dtype, seed=sum(shape))
    ours = w8a16_gemm(*(t.to(DEVICE) for t in (x, q, scale, bias)), block_n=32,
                      block_k=32).cpu()
    ref = w8a16_gemm_ref(x, q, scale, bias)
    w_float = q.float() * scale.float()[:, None]
    magnitude = x.float().abs() @ w_float.abs().t() + bias.float().abs()
    tol = (1e-5 if dtype == torch.float32 else 2**-7) * magnitude + 1e-6
    assert ours.dtype == dtype and ours.shape == (m, n)
    assert ((ours.float() - ref.float()).abs() <= tol).all()


def test_w8a16_rejects_bad_operands():
    x, q, scale, _ = _case(2, 32, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="q must be int8"):
        w8a16_gemm(x, q.t().contiguous().t(), scale)
    with pytest.raises(ValueError, match="scale"):
        w8a16_gemm(x, q, scale[:-1])


@pytest.mark.parametrize("layer_class", [Int8Linear, Int8Head])
def test_int8_layer_triton_path_matches_cpu_path(layer_class):
    x, q, scale, bias = _case(33, 80, 200, torch.float32, seed=4)
    layers = {kernel: layer_class(q, scale, bias, torch.float32, kernel=kernel)
              for kernel in ("cpu", "triton")}
    ys = {kernel: layer.to(DEVICE)(x.to(DEVICE)).cpu() for kernel, layer in layers.items()}
    torch.testing.assert_close(ys["triton"], ys["cpu"], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="kernel"):
        Int8Linear(q, scale, bias, kernel="cublas")
