"""A float mixture of experts' matrices on servelm's CPU GEMMs (layers/linear.py,
pack_float_experts): float32 experts become DetLinears, bfloat16 ones DotLinears, where the
engine packs the dense linears for servelm's GEMMs (`--cpu-kernels gemm`). The experts then
compute what the float stacks did, and the decode stack takes the same layers (a step's bits
equal the eager model's: tests/models/test_family_parity.py)."""

import pytest
import torch

from servelm.layers.activation import silu_and_mul
from servelm.layers.amx_linear import amx_usable
from servelm.layers.det_linear import DetLinear
from servelm.layers.dot_linear import DotLinear, dot_usable
from servelm.layers.linear import can_pack, pack_float_experts, panel_rows
from servelm.layers.moe import Experts
from tiny_families import make_tiny_family_model
from tiny_models import make_tiny_engine

needs_panels = pytest.mark.skipif(
    panel_rows() == 0 or not can_pack(torch.device("cpu"), torch.float32),
    reason="no panel GEMM or no oneDNN on this CPU")
needs_dot = pytest.mark.skipif(not dot_usable() or amx_usable(),
                               reason="no avx512_bf16 dot products (or AMX takes bfloat16)")


def _experts(dtype=torch.float32) -> Experts:
    torch.manual_seed(0)
    experts = Experts(4, 32, 48, silu_and_mul)
    experts.w13.data.normal_(0, 0.1)
    experts.w2.data.normal_(0, 0.1)
    return experts.to(dtype)


def _route(tokens: int, k: int = 2):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(tokens)])
    return torch.rand(tokens, k, generator=g), ids


@needs_panels
def test_packed_float32_experts_compute_the_float_stacks_outputs():
    experts = _experts()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    weights, ids = _route(5)
    want = experts(x, weights, ids)
    assert pack_float_experts(experts, DetLinear) == 8
    assert experts.w13 is None and experts.w2 is None
    assert all(type(m) is DetLinear for m in [*experts.q13, *experts.q2])
    torch.testing.assert_close(experts(x, weights, ids), want, rtol=1e-5, atol=1e-5)
    assert experts.num_routed_tokens.sum() == 2 * 5 * 2  # both calls counted
    assert pack_float_experts(experts, DetLinear) == 0  # packed once


@needs_dot
def test_packed_bfloat16_experts_compute_the_float_stacks_outputs():
    experts = _experts(torch.bfloat16)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    weights, ids = _route(5)
    want = experts(x, weights, ids).float()
    assert pack_float_experts(experts, DotLinear) == 8
    assert all(type(m) is DotLinear for m in [*experts.q13, *experts.q2])
    torch.testing.assert_close(experts(x, weights, ids).float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [
    pytest.param("float32", marks=needs_panels), pytest.param("bfloat16", marks=needs_dot)])
def test_the_engine_packs_a_mixtures_experts_and_the_stack_takes_them(dtype):
    hf = make_tiny_family_model("mixtral")
    engine = make_tiny_engine(hf, cpu_kernels="decode=kernel", dtype=dtype)
    layer = {"float32": DetLinear, "bfloat16": DotLinear}[dtype]
    experts = [m for m in engine.runner.model.modules() if type(m) is Experts]
    assert experts and all(m.w13 is None and type(m.q13[0]) is layer for m in experts)
    assert engine.runner.cpu_stack_refusal is None


def test_gemm_torch_keeps_the_float_stacks():
    hf = make_tiny_family_model("mixtral")
    engine = make_tiny_engine(hf, cpu_kernels="gemm=torch")
    experts = [m for m in engine.runner.model.modules() if type(m) is Experts]
    assert experts and all(m.w13 is not None for m in experts)
