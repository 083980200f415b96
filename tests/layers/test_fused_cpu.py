"""The fused C++ layer ops (servelm/cpu_kernels/layer_ops.cpp) compute what the torch code of
servelm/layers computes: kernel against a float64 reference, module against module with
`--cpu-kernels layer_ops=torch`, and a tiny model's greedy tokens on either path.
"""

import pytest
import torch
import torch.nn.functional as F

from servelm import cpu_kernels
from servelm.layers import fused_cpu
from servelm.layers.activation import silu_and_mul
from servelm.layers.norm import RMSNorm
from servelm.layers.rotary import RotaryEmbedding
from servelm.llm import LLM
from servelm.protocol import SamplingParams


@pytest.fixture(scope="module")
def ops():
    return cpu_kernels.load()  # a failed build fails these tests, never skips them


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# [64, 576]: a decode step (one thread); [3000, 96]: enough rows to be shared out.
SHAPES = [(1, 576), (64, 576), (5, 7), (3000, 96)]


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(ops, shape):
    x, residual, weight = _randn(*shape, seed=1), _randn(*shape, seed=2), _randn(shape[-1], seed=3)

    def ref(v):
        v = v.double()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()).float()

    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), ref(x), atol=1e-5, rtol=1e-5)
    out, total = ops.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(total, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(out, ref(x + residual), atol=1e-5, rtol=1e-5)
    assert not torch.equal(x, total)  # inputs untouched, outputs fresh


def _rotate_ref(x, cos, sin):
    x1, x2 = x.double().chunk(2, dim=-1)
    cos, sin = cos.double(), sin.double()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).float()


@pytest.mark.parametrize("tokens,num_heads,num_kv_heads,head_dim", [
    (1, 9, 3, 64), (64, 9, 3, 64), (7, 4, 1, 16), (700, 8, 2, 128)])
def test_rotary_rotates_strided_views_in_place(ops, tokens, num_heads, num_kv_heads, head_dim):
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(tokens, q_size + 2 * kv_size, seed=tokens)  # as the fused projection gives it
    q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    v_before = qkv[:, q_size + kv_size:].clone()
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(5))
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    q_ref, k_ref = _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin)
    ops.rotary_(q, k, positions, rotary.cos, rotary.sin)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, q_size + kv_size:], v_before)  # v untouched


def test_rotary_rejects_a_position_past_the_table(ops):
    rotary = RotaryEmbedding(16, 32, 10000.0)
    q, k = torch.zeros(2, 2, 16), torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match="position 32"):
        ops.rotary_(q, k, torch.tensor([0, 32]), rotary.cos, rotary.sin)


@pytest.mark.parametrize("shape", [(1, 3072), (64, 3072), (3, 2 * 37), (300, 1024)])
def test_silu_and_mul_matches_reference(ops, shape):
    x = _randn(*shape, seed=shape[0], scale=4.0)
    x[0, :4] = torch.tensor([-100.0, 100.0, -87.5, 0.0])  # past exp's clamp, and zero
    gate, up = x.double().chunk(2, dim=-1)
    ref = (gate * torch.sigmoid(gate) * up).float()
    torch.testing.assert_close(ops.silu_and_mul(x), ref, atol=1e-5, rtol=1e-5)


BF16_ULP = 2.0 ** -7  # relative spacing of bfloat16 (8 significant bits)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_bf16_rms_norm_is_torchs(ops, shape, weight_dtype):
    """bfloat16 rows: the sum rounded to bfloat16 exactly as torch adds, the norm in float32
    rounded once, as torch.rms_norm computes it (at most one bfloat16 step apart: the order
    of the sum of squares)."""
    x = _randn(*shape, seed=1).bfloat16()
    residual = _randn(*shape, seed=2).bfloat16()
    weight = _randn(shape[-1], seed=3).to(weight_dtype)
    out, total = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert out.dtype == total.dtype == torch.bfloat16
    assert torch.equal(total, x + residual)
    ref = torch.rms_norm((x + residual).float(), (shape[-1],), weight.float(), 1e-5)
    torch.testing.assert_close(out.float(), ref, atol=1e-6, rtol=BF16_ULP)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5).float(),
                               torch.rms_norm(x.float(), (shape[-1],), weight.float(), 1e-5),
                               atol=1e-6, rtol=BF16_ULP)


def test_bf16_silu_and_rotary_round_the_float32_result_once(ops):
    x = _randn(64, 2 * 1536, seed=4, scale=4.0).bfloat16()
    gate, up = x.double().chunk(2, dim=-1)
    want = (gate * torch.sigmoid(gate) * up).float().bfloat16()
    got = ops.silu_and_mul(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=BF16_ULP)
    rotary = RotaryEmbedding(64, 4096, 10000.0)
    q, k = _randn(7, 9, 64, seed=5).bfloat16(), _randn(7, 3, 64, seed=6).bfloat16()
    positions = torch.tensor([0, 1, 5, 100, 999, 2048, 4095])
    q32, k32 = q.float(), k.float()
    ops.rotary_(q, k, positions, rotary.cos, rotary.sin)
    ops.rotary_(q32, k32, positions, rotary.cos, rotary.sin)
    assert torch.equal(q, q32.bfloat16()) and torch.equal(k, k32.bfloat16())
    with pytest.raises(RuntimeError, match="both the same"):
        ops.rotary_(q, k32, positions, rotary.cos, rotary.sin)


def _both_paths(cpu_kernel_mode, fn):
    results = {}
    for path in ("kernel", "torch"):
        cpu_kernel_mode(fused_cpu.PART, path)
        results[path] = fn()
    return results["kernel"], results["torch"]


def test_layers_take_the_fused_path_only_where_it_applies(ops, cpu_kernel_mode):
    cpu_kernel_mode(fused_cpu.PART, "auto")
    assert fused_cpu.fused_ops(torch.zeros(2, 16)) is ops
    assert fused_cpu.fused_ops(torch.zeros(2, 16, dtype=torch.bfloat16)) is ops
    assert fused_cpu.fused_ops(torch.zeros(2, 16, dtype=torch.float16)) is None
    assert fused_cpu.fused_ops(torch.zeros(2, 16, device="meta")) is None
    cpu_kernel_mode(fused_cpu.PART, "torch")
    assert fused_cpu.fused_ops(torch.zeros(2, 16)) is None


def test_modules_agree_on_either_path(ops, cpu_kernel_mode):
    norm = RMSNorm(96, eps=1e-6)
    norm.weight.data = _randn(96, seed=9)
    x, residual = _randn(33, 96, seed=10), _randn(33, 96, seed=11)
    fused, plain = _both_paths(cpu_kernel_mode, lambda: norm(x, residual))
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    fused, plain = _both_paths(cpu_kernel_mode, lambda: norm(x))
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    fused, plain = _both_paths(cpu_kernel_mode, lambda: silu_and_mul(x))
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    rotary = RotaryEmbedding(32, 512, 500000.0,
                             {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    positions = torch.arange(100, 133)
    q, k = _randn(33, 3, 32, seed=12), _randn(33, 1, 32, seed=13)
    fused, plain = _both_paths(cpu_kernel_mode, lambda: rotary(positions, q.clone(), k.clone()))
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_greedy_tokens_match_torch_layers(ops, tiny_hf, tiny_engine, arch):
    hf = tiny_hf(arch)
    prompts = [[5, 17, 99, 3, 250, 11, 42], list(range(100, 160)), [7]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)

    def run(path):
        # decode=torch: the decode stack would run its own fused ops whatever layer_ops says
        engine = tiny_engine(hf, max_num_batched_tokens=32,
                             cpu_kernels=f"layer_ops={path},decode=torch")
        assert (fused_cpu.fused_ops(torch.zeros(1, 16)) is not None) == (path == "kernel")
        outs = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
        return [o.outputs[0] for o in outs]

    fused, plain = run("kernel"), run("torch")
    for ours, ref in zip(fused, plain):
        assert ours.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in ours.logprobs]),
                                   torch.tensor([lp.logprob for lp in ref.logprobs]),
                                   atol=1e-4, rtol=1e-4)
