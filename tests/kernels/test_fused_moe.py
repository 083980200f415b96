"""The Triton fused MoE (grouped GEMMs over the assignments sorted by expert) against its
torch reference and against the CPU Experts layer: odd sizes, experts with no tokens, one
token, k = 1 and k = 3, fp32 and bf16."""

import pytest
import torch

from servelm.kernels.fused_moe import Segments, fused_moe, fused_moe_ref, grouped_gemm
from servelm.layers.activation import act_and_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SILU = act_and_mul("silu")


def _case(t, e, k, hidden, inter, dtype, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(e, hidden, inter, generator=g) * 0.1
    logits = torch.randn(t, e, generator=g)
    if skew:  # most tokens to two experts, several experts with none
        logits[:, :2] += 4.0
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return [v.to(dtype).to(DEVICE) if v.is_floating_point() else v.to(DEVICE)
            for v in (x, w13, w2, weights, ids)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,k,hidden,inter,skew", [
    (1, 4, 2, 48, 40, False), (9, 8, 1, 64, 24, True), (33, 6, 3, 40, 72, False),
    (17, 16, 2, 96, 48, True)])
def test_fused_moe_matches_reference(t, e, k, hidden, inter, skew, dtype):
    x, w13, w2, weights, ids = _case(t, e, k, hidden, inter, dtype, seed=t * e, skew=skew)
    ours = fused_moe(x, w13, w2, weights, ids, SILU).float().cpu()
    ref = fused_moe_ref(x, w13, w2, weights, ids, SILU).float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


def test_grouped_gemm_rows_are_each_experts_product():
    x, w13, _, _, ids = _case(13, 8, 2, 32, 16, torch.float32, seed=5, skew=True)
    seg = Segments(ids, 8)
    assert int(seg.counts.eq(0).sum()) > 0  # some experts get no token: no segment for them
    out = grouped_gemm(x, w13, seg, seg.src).cpu()
    flat = ids.reshape(-1)[seg.order].cpu()
    for a in range(out.shape[0]):
        want = x[int(seg.src[a])].cpu() @ w13[int(flat[a])].cpu().t()
        torch.testing.assert_close(out[a], want, atol=1e-4, rtol=1e-4)


def test_fused_moe_equals_the_cpu_experts_layer():
    from servelm.layers.moe import Experts

    x, w13, w2, weights, ids = _case(21, 8, 2, 64, 32, torch.float32, seed=11)
    experts = Experts(8, 64, 32, SILU)
    experts.w13.data, experts.w2.data = w13.cpu().clone(), w2.cpu().clone()
    cpu = experts(x.cpu(), weights.cpu(), ids.cpu())
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, SILU).cpu(), cpu,
                               atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_refused():
    x, w13, _, _, ids = _case(3, 4, 2, 16, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="grouped_gemm wants"):
        grouped_gemm(x, w13[:, :, :8], Segments(ids, 4))
