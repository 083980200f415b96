"""Deterministic mode's GPU kernels (servelm/kernels/batch_invariant.py): a row's result is
the same bits at any batch size and any place in the batch, and it is the matmul / RMSNorm
the torch reference computes."""

import pytest
import torch

from servelm.kernels.batch_invariant import (bi_matmul, bi_matmul_ref, bi_rms_norm,
                                             bi_rms_norm_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(96, 80), (64, 64)])
def test_matmul_rows_are_the_same_bits_in_any_batch(dtype, k, n):
    x = _rand(70, k, seed=0, dtype=dtype)
    w = _rand(n, k, seed=1, dtype=dtype)
    bias = _rand(n, seed=2, dtype=dtype)
    full = bi_matmul(x, w, bias)
    for rows in ([5], [69, 3], list(range(33)), list(range(40, 70)), [0, 35, 64]):
        assert torch.equal(bi_matmul(x[rows], w, bias), full[rows]), rows
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(full, bi_matmul_ref(x, w, bias), **tol)


def test_matmul_refuses_a_bad_weight():
    x = _rand(4, 16, seed=0)
    with pytest.raises(ValueError, match="w must be"):
        bi_matmul(x, _rand(8, 12, seed=1))
    with pytest.raises(ValueError, match="bias must be"):
        bi_matmul(x, _rand(8, 16, seed=1), _rand(7, seed=2))


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_rows_are_the_same_bits_in_any_batch(with_residual):
    x = _rand(37, 96, seed=5)
    res = _rand(37, 96, seed=6) if with_residual else None
    weight = _rand(96, seed=7)
    full = bi_rms_norm(x, weight, 1e-6, res)
    ref = bi_rms_norm_ref(x, weight, 1e-6, res)
    for rows in ([0], [36, 2], list(range(20))):
        part = bi_rms_norm(x[rows], weight, 1e-6, None if res is None else res[rows])
        if with_residual:
            assert torch.equal(part[0], full[0][rows]) and torch.equal(part[1], full[1][rows])
        else:
            assert torch.equal(part, full[rows])
    if with_residual:
        torch.testing.assert_close(full[0], ref[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(full[1], ref[1])
    else:
        torch.testing.assert_close(full, ref, atol=1e-5, rtol=1e-5)
