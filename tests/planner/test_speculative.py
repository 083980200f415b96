import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servelm.planner.errors import PlanInputError
from servelm.planner.speculative import (
    break_even_batch,
    expected_tokens_per_step,
    plan_spec,
    spec_step,
)


def test_expected_tokens_formula():
    # Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding"),
    # eq. 1: E = (1 - a^(k+1)) / (1 - a). a=0.8, k=4: (1 - 0.32768) / 0.2 = 3.3616.
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0


@given(a=st.floats(0, 0.999), k=st.integers(1, 16))
def test_expected_tokens_is_the_geometric_sum(a, k):
    assert expected_tokens_per_step(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))


def test_break_even_is_a_boundary(deploy):
    d = deploy("Llama-3.1-70B", tp=4)
    be = break_even_batch(d, 256, 0.7, 4, 0.05)
    assert 1 < be < math.inf
    assert spec_step(d, int(be), 256, 0.7, 4, 0.05).speedup >= 1
    assert spec_step(d, int(be) + 1, 256, 0.7, 4, 0.05).speedup < 1


def test_memory_bound_speedup_is_e_over_draft_overhead(deploy):
    # At batch 1 verification of k+1 tokens costs the same as one token (weight-read bound),
    # so speedup = E / (1 + k x draft_cost).
    p = plan_spec(deploy("Llama-3.1-70B", tp=4), 0.7, 4, batch=1, context=128)
    assert p.speedup == pytest.approx(expected_tokens_per_step(0.7, 4) / 1.2, rel=0.01)


def test_expensive_draft_never_pays(deploy):
    assert break_even_batch(deploy(tp=1), 128, 0.3, 4, 0.5) == 0


def test_long_context_keeps_paying(deploy):
    # KV reads keep plain decode memory-bound (MagicDec, Chen et al. 2024).
    p = plan_spec(deploy(tp=1), 0.8, 4, batch=64, context=32768)
    assert math.isinf(p.break_even_batch)


def test_bad_inputs(deploy):
    with pytest.raises(PlanInputError, match="--acceptance"):
        plan_spec(deploy(), 1.5, 4)
    with pytest.raises(PlanInputError, match="--draft-cost"):
        plan_spec(deploy(), 0.5, 4, draft_cost=2)
