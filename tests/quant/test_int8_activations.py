"""Int8 activations (servelm/quant/int8_act.py, cpu_kernels/quant_gemm_a8.cpp): the activation
rounding is bit for bit a torch reference of the same math; the int4 / int8 GEMMs equal that
integer math up to float rounding for odd shapes and M in {1, 3, 64}; layers built with
activations="int8" run it (and keep float activations when the CPU probe says no); a tiny
Llama served with --quant-activations int8 agrees with float activations, and its decode
stack gives the eager model's tokens and logprobs."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from servelm import cpu_kernels
from servelm.quant import int8_act
from servelm.quant.cpu_panels import (pack_int4_panels, pack_int4_vnni, pack_int8_panels,
                                      pack_int8_vnni, unpack_int4_vnni, unpack_int8_vnni)
from servelm.quant.int4_linear import Int4Linear, quantize_int4_groups
from servelm.quant.int8_linear import Int8Linear, quantize_int8_groups

ops = cpu_kernels.load()
needs_vnni = pytest.mark.skipif(not int8_act.int8_dot_usable(),
                                reason="this CPU runs neither avx512_vnni nor the AVX2 path")


@pytest.fixture(autouse=True)
def _fresh_probe():
    yield
    int8_act.set_probe_result(None)


def reference_act_int8(x: torch.Tensor, kp: int):
    """The kernels' activation rounding in torch: per row and 32 columns (zero-padded to kp),
    d = max|x| / 127, q = round-half-even(x * (1 / d)), 0 where d = 0."""
    m, k = x.shape
    xg = F.pad(x, (0, kp - k)).view(m, kp // 32, 32)
    d = xg.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xg * inv[..., None])
    return q.view(m, kp).to(torch.int8), d, q.sum(-1).to(torch.int32)


def dequantized_x(x: torch.Tensor, kp: int) -> torch.Tensor:
    q, d, _ = reference_act_int8(x, kp)
    return (q.double().view(len(x), -1, 32) * d.double()[..., None]).view(len(x), kp)


def _x(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[0, :5] = 0.0  # a group with a few zeros; the all-zero group below
    if k >= 64:
        x[-1, 32:64] = 0.0
    return x


@pytest.mark.parametrize("m,k", [(1, 576), (3, 100), (64, 1536)])
def test_activation_rounding_is_the_torch_reference_bit_for_bit(m, k):
    x = _x(m, k)
    kp = -(-k // 32) * 32
    for got, want in zip(ops.quantize_act_int8(x, kp), reference_act_int8(x, kp)):
        assert torch.equal(got, want)


@needs_vnni
@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("n,k,group", [(37, 100, 32), (960, 576, 32), (50, 192, 64),
                                       (576, 1536, 128)])
@pytest.mark.parametrize("so_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_a8_gemm_is_the_integer_math(m, n, k, group, so_dtype):
    g = torch.Generator().manual_seed(n + k)
    kp = -(-k // 32) * 32
    num_groups = -(-kp // group)
    q = torch.randint(0, 16, (n, kp), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, num_groups, generator=g) * 0.02).to(so_dtype)
    offset = (torch.randn(n, num_groups, generator=g) * 0.02).to(so_dtype)
    codes = pack_int4_vnni(q)
    assert torch.equal(unpack_int4_vnni(codes, n), q)
    _, so = pack_int4_panels(q, scale, offset, so_dtype)  # (scale, offset) in the sz layout
    x = _x(m, k)
    y = ops.int4_gemm_a8(x, codes, so, n, group)  # x of width k: the op pads to kp
    rep = lambda t: t.double().repeat_interleave(group, dim=1)[:, :kp]  # noqa: E731
    w = q.double() * rep(scale) + rep(offset)
    want = dequantized_x(x, kp) @ w.t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_vnni
@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("n,k,group,dtype", [(37, 100, 0, torch.float32),
                                             (37, 100, 32, torch.float16),
                                             (960, 576, 32, torch.float32),
                                             (49, 1536, 0, torch.bfloat16),
                                             (33, 256, 64, torch.float32)])
def test_int8_a8_gemm_is_the_integer_math(m, n, k, group, dtype):
    g = torch.Generator().manual_seed(n * k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    num_groups = -(-k // group) if group else 1
    scale = (torch.rand(n, num_groups, generator=g) * 0.01).to(dtype).float()
    codes = pack_int8_vnni(q)
    assert torch.equal(unpack_int8_vnni(codes, n, k), q)
    _, scale32 = pack_int8_panels(q, scale[:, 0] if group == 0 else scale)
    x = _x(m, k)
    y = ops.int8_gemm_a8(x, codes, scale32.to(dtype), n, group)
    kp = codes.shape[1] * 4
    s = scale.double().repeat_interleave(group or k, dim=1)[:, :k]
    w = F.pad(q.double() * s, (0, kp - k))
    want = dequantized_x(x, kp) @ w.t()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a8_ops_refuse_bad_inputs():
    q = torch.randint(-127, 128, (20, 64), dtype=torch.int8)
    codes = pack_int8_vnni(q)
    _, scale = pack_int8_panels(q, torch.rand(20))
    with pytest.raises(RuntimeError, match="group must be 0"):
        ops.int8_gemm_a8(torch.randn(2, 64), codes, scale, 20, 16)
    with pytest.raises(RuntimeError, match="K in"):
        ops.int8_gemm_a8(torch.randn(2, 20), codes, scale, 20, 0)  # far narrower than Kp
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.int8_gemm_a8(torch.randn(2, 64), codes, scale, 40, 0)
    with pytest.raises(RuntimeError, match="Kp/8, 16, 4"):
        ops.int4_gemm_a8(torch.randn(2, 64), codes[:, :3].contiguous(), torch.zeros(2, 2, 2, 16),
                         20, 32)


def test_probe_says_what_the_cpu_runs():
    flags = set(next((line for line in open("/proc/cpuinfo") if line.startswith("flags")),
                     "").split())
    path = ops.int8_dot_path()
    if "avx512_vnni" in flags:
        assert path == "avx512_vnni"
    elif "avx512bw" in flags:  # the emulation builds, but is not the fast path
        assert path == "" and not ops.int8_dot_probe()
    elif "avx2" in flags:
        assert path == "avx2"
    else:
        assert path == "" and not ops.int8_dot_probe()
    if path:  # advertised: the forked child ran it (unless this is a VM that traps on it)
        assert isinstance(ops.int8_dot_probe(), bool)
        assert ops.int8_dot_probe() == ops.int8_dot_probe()


def _layers(activations):
    """An int4 and an int8 layer (72 x 100, groups of 32) asked for `activations`, and the
    int4 layer with float activations."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(72, 100, generator=g) * 0.05
    q, scale, zero = quantize_int4_groups(w, 32)
    a = Int4Linear(q, scale, zero, 32, None, torch.float32, kernel="cpu", activations=activations)
    q8, s8 = quantize_int8_groups(w, 32)
    b = Int8Linear(q8, s8, torch.randn(72), torch.float32, kernel="cpu", group_size=32,
                   activations=activations)
    f = Int4Linear(q, scale, zero, 32, None, torch.float32, kernel="cpu")
    return a, b, f


@needs_vnni
def test_layers_with_int8_activations_run_the_a8_kernels():
    int4, int8, int4_float = _layers("int8")
    assert int4.activations == int8.activations == "int8"
    assert "activations=int8" in repr(int4)
    # the same weight, as q * scale + (zero - 8 scale): float32 rounding apart
    torch.testing.assert_close(int4.dequantize(), int4_float.dequantize(), rtol=1e-6, atol=1e-8)
    x = _x(5, 100)
    y = int4(x)
    torch.testing.assert_close(y, ops.int4_gemm_a8(F.pad(x, (0, 28)), int4.codes, int4.so, 72, 32))
    # int8 activations move the result by the activations' rounding only (~0.4% per group)
    ref = x @ int4.dequantize().t()
    assert (y - ref).norm() / ref.norm() < 0.02
    ref8 = x @ int8.dequantize().t() + int8.bias
    assert (int8(x) - ref8).norm() / ref8.norm() < 0.02


def test_without_vnni_the_layers_keep_float_activations(caplog):
    int8_act.set_probe_result(False)  # a CPU without the dot products
    with caplog.at_level(logging.WARNING, logger="servelm.quant.int8_act"):
        int4, int8, int4_float = _layers("int8")
    assert int4.activations == int8.activations == "float"
    assert "needs avx512_vnni or AVX2" in caplog.text
    assert caplog.text.count("needs avx512_vnni") == 1
    x = _x(3, 100)
    assert torch.equal(int4(x), int4_float(x))  # the float kernel, bit for bit


def test_unknown_activations_are_refused_by_name():
    from servelm.config import EngineArgs
    from servelm.protocol import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="quant_activations 'int4'") as e:
        EngineArgs(model="x", quant_activations="int4")
    assert e.value.param == "quant_activations"


PROMPTS = [[5, 17, 99, 3, 250, 11, 42], list(range(100, 160)), [7], list(range(200, 223))]


def _generate(engine, max_tokens=16):
    from servelm.llm import LLM
    from servelm.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in LLM(engine=engine).generate(PROMPTS, params, use_tqdm=False)]


def _teacher_forced_agreement(a, b, outs) -> tuple[int, int]:
    """Next-token choices of engines a and b on a's own continuations: (same, total)."""
    from tiny_models import prefill_logits

    same = total = 0
    for prompt, out in zip(PROMPTS, outs):
        ids = prompt + out.token_ids
        x = prefill_logits(a, ids).argmax(-1)[len(prompt) - 1:-1]
        y = prefill_logits(b, ids).argmax(-1)[len(prompt) - 1:-1]
        same, total = same + (x == y).sum().item(), total + len(out.token_ids)
    return same, total


def _stack_equals_eager(hf, tiny_engine, **kw):
    """Generate with the decode stack and eagerly: the same tokens and logprobs, exactly."""
    engine = tiny_engine(hf, cpu_kernels="decode=kernel", **kw)
    outs = _generate(engine)
    assert engine.runner.cpu_stack.steps >= 10
    eager = tiny_engine(hf, cpu_kernels="decode=torch", **kw)
    for a, b in zip(outs, _generate(eager)):
        assert a.token_ids == b.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs] == \
            [(lp.token_id, lp.logprob, lp.top) for lp in b.logprobs]
    return engine


@needs_vnni
@pytest.mark.parametrize("method,min_agree", [("int8", 0.9), ("int4-g32", 0.9)])
def test_tiny_llama_with_int8_activations(method, min_agree, tiny_hf, tiny_engine):
    """Served with --quant-activations int8: every quantized layer (the head too) runs the a8
    kernels, next-token choices agree with float activations, and the decode stack gives
    the eager path's tokens and logprobs exactly."""
    hf = tiny_hf("llama")
    kw = dict(quantization=method, max_num_batched_tokens=32)
    a8 = _stack_equals_eager(hf, tiny_engine, quant_activations="int8", **kw)
    model = a8.runner.model
    layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert len(layers) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down; the head
    assert all(m.activations == "int8" for m in layers)
    fl = tiny_engine(hf, **kw)
    assert all(m.activations == "float" for m in fl.runner.model.modules()
               if isinstance(m, (Int4Linear, Int8Linear)))
    same, total = _teacher_forced_agreement(fl, a8, _generate(fl))
    print(f"{method}: int8 vs float activations, {same}/{total} next tokens agree")
    assert same / total >= min_agree, f"{method}: {same}/{total} next tokens agree"


@needs_vnni
def test_a8_ops_take_bfloat16_rows():
    """bfloat16 rows round to the same int8 codes as their float32 values: the result is the
    float32 rows' result, rounded to bfloat16."""
    q = torch.randint(-127, 128, (40, 96), dtype=torch.int8)
    codes, (_, scale) = pack_int8_vnni(q), pack_int8_panels(q, torch.rand(40))
    q4 = torch.randint(0, 16, (40, 96), dtype=torch.uint8)
    _, sz = pack_int4_panels(q4, torch.rand(40, 3), torch.rand(40, 3), torch.float32)
    x = _x(3, 96).bfloat16()
    for op, c, s, g in ((ops.int8_gemm_a8, codes, scale, 0),
                        (ops.int4_gemm_a8, pack_int4_vnni(q4), sz, 32)):
        y = op(x, c, s, 40, g)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, op(x.float(), c, s, 40, g).bfloat16())


def _layer_ops_take_bf16() -> bool:
    try:
        ops.rms_norm(torch.ones(1, 16, dtype=torch.bfloat16), torch.ones(16), 1e-6)
        return True
    except RuntimeError:
        return False


@needs_vnni
@pytest.mark.skipif(not _layer_ops_take_bf16(),
                    reason="the stack's layer ops (layer_ops.cpp) take no bfloat16 rows here")
def test_bfloat16_model_with_int8_activations_runs_in_the_stack(tiny_hf, tiny_engine):
    """bfloat16 rows go into the int8-activation kernels as they are (no float32 copy), so a
    bfloat16 model's quantized layers run in the decode stack too (qwen2: q/k/v biases)."""
    engine = _stack_equals_eager(tiny_hf("qwen2"), tiny_engine, quantization="int4-g32",
                                 quant_activations="int8", dtype="bfloat16",
                                 max_num_batched_tokens=32)
    assert engine.runner.model.layers[0].mlp.down_proj.activations == "int8"


@needs_vnni
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_keep_their_float16_scales(kind):
    """GGUF's d (and Q4_1's m) are float16 in the file: the int8-activation layers store them
    so (half the scale bytes of float32) and compute with exactly gguf-py's weights."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from servelm.quant import get_quant_method
    from servelm.quant.gguf_blocks import GGUFBlocks

    w = np.random.default_rng(0).normal(0, 0.05, (96, 192)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[kind])
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]))
    blocks = GGUFBlocks(kind, torch.from_numpy(raw), (96, 192))
    layer = get_quant_method("gguf", activations="int8").from_blocks(blocks, None)
    assert layer.activations == "int8"
    scales = layer.scale32 if kind == "Q8_0" else layer.so
    assert scales.dtype == torch.float16
    assert torch.equal(layer.dequantize(), ref)
    x = _x(4, 192)
    want = dequantized_x(x, 192) @ ref.double().t()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
