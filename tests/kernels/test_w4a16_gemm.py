"""Triton w4a16 GEMM (int4 group-wise asymmetric weights, 16/32-bit activations) against its
torch reference, and Int4Linear's Triton path against its CPU path on the same codes.

Odd shapes on purpose: M = 1 (decode) and 33 (past one 16/64-row tile), K not a multiple of
the K tile, of 8 (one int32 word) or of the group (a short last group), N not a multiple of
the N tile; groups of 32/64/128.
"""

import pytest
import torch

from servelm.kernels.int4_layout import pack_int4_along_k, unpack_int4_along_k
from servelm.kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref
from servelm.quant.int4_linear import Int4Linear, quantize_int4_groups
from servelm.quant.quantized_weight import QuantizedWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (M, N, K, group)
SHAPES = [(1, 48, 100, 32), (33, 80, 200, 64), (1, 96, 300, 128), (33, 16, 130, 128),
          (17, 72, 64, 32), (64, 40, 257, 64)]


def _case(m, n, k, group, dtype, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[::5, ::11] *= 6  # outliers: groups with wide ranges
    q, scale, zero = quantize_int4_groups(w, group, torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    weight = QuantizedWeight("int4", q, scale.to(torch.bfloat16), zero.to(torch.bfloat16), group)
    return x, weight, b


def _tolerance(x, w_float, bias, dtype):
    """Elementwise bound on |ours - ref|: float32 summation order, or for 16-bit outputs one
    output rounding each side (and, on a GPU, the weight tile rounded before the dot)."""
    magnitude = x.float().abs() @ w_float.abs().t()
    if bias is not None:
        magnitude = magnitude + bias.float().abs()
    return (1e-5 if dtype == torch.float32 else 2**-7) * magnitude + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}N{}K{}g{}".format(*s))
def test_w4a16_matches_reference(shape, dtype):
    m, n, k, group = shape
    x, weight, bias = _case(m, n, k, group, dtype, seed=sum(shape))
    qw = pack_int4_along_k(weight.q)
    args = (qw, weight.scale.t().contiguous(), weight.zero.t().contiguous(), group)
    dev = [t.to(DEVICE) for t in (x, *args[:3], bias)]
    ours = w4a16_gemm(dev[0], *dev[1:4], group, dev[4], block_n=32).cpu()
    ref = w4a16_gemm_ref(x, *args, bias)
    # the reference is QuantizedWeight's own dequantization times x
    w_float = weight.dequantize()
    exact = (x.float() @ w_float.t() + bias.float()).to(dtype)
    tol = _tolerance(x, w_float, bias, dtype)
    assert ((ref.float() - exact.float()).abs() <= tol).all()
    assert ours.dtype == dtype and ours.shape == (m, n)
    assert ((ours.float() - ref.float()).abs() <= tol).all(), (ours.float() - ref.float()).abs().max()


def test_w4a16_without_bias_and_wide_n_tile():
    x, weight, _ = _case(5, 130, 96, 32, torch.float32, seed=1, bias=False)
    qw = pack_int4_along_k(weight.q)
    s, z = weight.scale.t().contiguous(), weight.zero.t().contiguous()
    ours = w4a16_gemm(*(t.to(DEVICE) for t in (x, qw, s, z)), 32, block_n=64).cpu()
    torch.testing.assert_close(ours, w4a16_gemm_ref(x, qw, s, z, 32), atol=1e-4, rtol=1e-5)


def test_w4a16_rejects_mismatched_layouts():
    x, weight, _ = _case(2, 32, 64, 32, torch.float32, seed=2)
    qw = pack_int4_along_k(weight.q)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_gemm(x, qw[:-1], weight.scale.t(), weight.zero.t(), 32)
    with pytest.raises(ValueError, match="scale/zero"):
        w4a16_gemm(x, qw, weight.scale, weight.zero, 32)


@pytest.mark.parametrize("k", [1, 7, 8, 9, 100])
def test_pack_int4_along_k_round_trips(k):
    q = torch.randint(0, 16, (24, k), generator=torch.Generator().manual_seed(k),
                      dtype=torch.uint8)
    packed = pack_int4_along_k(q)
    assert packed.dtype == torch.int32 and packed.shape == (-(-k // 8), 24)
    assert torch.equal(unpack_int4_along_k(packed, k), q)
    # nibble j of word [i, n] is q[n, 8 i + j]
    assert (packed[0, 3].item() & 0xF) == q[3, 0].item()
    if k > 1:
        assert ((packed[0, 3].item() >> 4) & 0xF) == q[3, 1].item()


@pytest.mark.parametrize("shape", [(48, 100, 32), (80, 200, 64), (16, 130, 128)],
                         ids=lambda s: "N{}K{}g{}".format(*s))
def test_int4_linear_triton_path_matches_cpu_path(shape):
    """The same codes through Int4Linear's two kernels: the Triton w4a16 GEMM (its CUDA path,
    interpreted here) and aten's CPU int4 op, both in float32 (exact up to summation order)."""
    n, k, group = shape
    x, weight, bias = _case(33, n, k, group, torch.float32, seed=n + k)
    layers = {kernel: Int4Linear(weight.q, weight.scale, weight.zero, group, bias,
                                 torch.float32, kernel=kernel) for kernel in ("cpu", "triton")}
    assert torch.equal(layers["triton"].dequantize(), layers["cpu"].dequantize())
    assert torch.equal(layers["triton"].dequantize(), weight.dequantize())
    ys = {kernel: layer.to(DEVICE)(x.to(DEVICE)).cpu() for kernel, layer in layers.items()}
    torch.testing.assert_close(ys["triton"], ys["cpu"], atol=1e-4, rtol=1e-5)
    # the Triton layout takes no padding: half a byte per weight plus two bf16 per group
    assert layers["triton"].num_weight_bytes == 4 * -(-k // 8) * n + 2 * 4 * -(-k // group) * n


def test_int4_linear_picks_its_kernel_by_device():
    _, weight, bias = _case(1, 32, 64, 32, torch.float32, seed=3)
    assert Int4Linear(weight.q, weight.scale, weight.zero, 32, bias).kernel == "cpu"
    with pytest.raises(ValueError, match="kernel"):
        Int4Linear(weight.q, weight.scale, weight.zero, 32, bias, kernel="cutlass")
    if torch.cuda.is_available():
        layer = Int4Linear(weight.q.cuda(), weight.scale.cuda(), weight.zero.cuda(), 32,
                           bias.cuda())
        assert layer.kernel == "triton"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int4_model_on_gpu_runs_the_triton_kernel(tiny_hf, tiny_engine):
    """--quantization int4-g32 --device cuda: every Int4Linear is built on the GPU and takes
    the Triton path; greedy tokens match the CPU int4 model's (same codes, bf16 activations
    on both sides) on their first steps."""
    from servelm.llm import LLM
    from servelm.protocol import SamplingParams

    hf = tiny_hf("llama")
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 250, 11, 42], [1, 2, 3, 4], [300, 200, 100, 50, 25]]
    outs = {}
    for device in ("cpu", "cuda"):
        engine = tiny_engine(hf, device=device, dtype="bfloat16", quantization="int4-g32",
                             attention_backend="triton" if device == "cuda" else "torch")
        outs[device] = [o.outputs[0].token_ids
                        for o in LLM(engine=engine).generate(prompts, greedy, use_tqdm=False)]
    layers = [m for m in engine.runner.model.modules() if isinstance(m, Int4Linear)]
    assert layers and all(m.kernel == "triton" for m in layers)
    assert sum(a[0] == b[0] for a, b in zip(outs["cpu"], outs["cuda"])) >= 2, outs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gguf_blocks_decode_on_the_gpu(default_model_path):
    """--quantization gguf --device cuda: the Q4_1 blocks are decoded on the GPU, so the
    layers get the Triton layout, and the model still answers."""
    from servelm.llm import LLM
    from servelm.protocol import SamplingParams

    llm = LLM("smollm2-135m-instruct", device="cuda", dtype="bfloat16", quantization="gguf",
              attention_backend="triton", kv_cache_memory=64 * 2**20, max_model_len=1024)
    layer = llm.engine.runner.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, Int4Linear) and layer.kernel == "triton"
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
