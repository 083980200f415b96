"""SpecController: speculation on at small batch, off past the break-even batch, back on
when the batch shrinks, all from measured step times and acceptance."""

import random

from servelm.planner.speculative import expected_tokens_per_step
from servelm.spec import SpecController


def _feed(ctl, c0, cd, cv, cp=0.001, n=48, seed=0):
    """Steps of mixed shapes, timed by T = c0 + cd d + cv v + cp p."""
    rng = random.Random(seed)
    for _ in range(n):
        d, v = rng.choice([(rng.randint(1, 64), 0), (rng.randint(0, 8), rng.randint(5, 320))])
        p = rng.choice([0, 0, 0, rng.randint(16, 512)])
        ctl.observe_step(c0 + cd * d + cv * v + cp * p, d, v, p)


def test_explores_then_probes():
    ctl = SpecController(4)
    assert ctl.draft_len(8) == 4  # nothing measured yet: try speculating
    for _ in range(10):
        ctl.observe_step(0.05, decode=8)
    assert ctl.draft_len(8) == 4  # verification cost unknown
    ctl2 = SpecController(4)
    for _ in range(10):
        ctl2.observe_step(0.08, verify=40)
    assert ctl2.draft_len(8) == 0 and ctl2.num_probes == 1  # a plain decode's cost unknown


def test_fits_the_step_cost():
    ctl = SpecController(4)
    _feed(ctl, 0.05, 0.002, 0.006, 0.001)
    c = ctl.step_time_model()
    assert abs(c.c0 - 0.05) < 1e-6 and abs(c.decode - 0.002) < 1e-8
    assert abs(c.verify - 0.006) < 1e-8 and abs(c.prefill - 0.001) < 1e-8


def test_switches_off_past_break_even_and_back_on():
    # A memory-bound CPU-like step: 50 ms fixed + 2 ms per token; acceptance 0.7.
    ctl = SpecController(4, prior_acceptance=0.7)
    _feed(ctl, 0.05, 0.002, 0.002)
    assert ctl.draft_len(1) >= 3  # the step costs ~the same for 1 or 5 tokens
    assert ctl.draft_len(256) == 0  # compute-bound: each rejected draft is paid for
    assert ctl.num_off_steps == 1
    assert ctl.draft_len(2) > 0  # the batch shrank: back on
    be = ctl.break_even_batch()
    assert 1 < be < 256
    assert ctl._best_k(be) == 0 and ctl._best_k(be - 1) > 0


def test_costlier_verification_tokens_turn_it_off_sooner():
    """On the CPU a (k+1)-token verification is attended like a prefill chunk: its tokens
    cost more than decode tokens, and the measured cost moves the break-even batch down."""
    same, costly = SpecController(4, prior_acceptance=0.8), SpecController(4, prior_acceptance=0.8)
    _feed(same, 0.1, 0.002, 0.002)
    _feed(costly, 0.1, 0.002, 0.008)
    assert costly.break_even_batch() < same.break_even_batch()


def test_decision_matches_the_formula():
    """rate(k) vs rate(0) at batch B by hand, with E from the planner (f = 1, no draft)."""
    ctl = SpecController(2, prior_acceptance=0.5)
    _feed(ctl, 0.1, 0.01, 0.015)
    a = 0.5
    for b in (1, 4, 16, 64):
        rates = [b / (0.1 + 0.01 * b)] + [
            b * expected_tokens_per_step(a, k) / (0.1 + 0.015 * b * (1 + k)) for k in (1, 2)]
        best = max(range(3), key=lambda k: rates[k])
        assert ctl._best_k(b) == best


def test_acceptance_estimate_tracks_verifications():
    ctl = SpecController(4, prior_acceptance=0.5)
    for _ in range(200):
        ctl.observe_verify(4, 4)  # all accepted
    assert ctl.acceptance > 0.95
    for _ in range(400):
        ctl.observe_verify(4, 0)  # first draft rejected every time
    assert ctl.acceptance < 0.05


def test_costly_draft_turns_speculation_off_sooner():
    cheap, costly = SpecController(4, prior_acceptance=0.6), SpecController(4, prior_acceptance=0.6)
    for ctl in (cheap, costly):
        _feed(ctl, 0.05, 0.002, 0.002)
    costly.draft_ratio = 0.5  # each draft step costs half a target step
    assert costly.break_even_batch() < cheap.break_even_batch()


def test_not_adaptive_always_speculates():
    ctl = SpecController(3, adaptive=False)
    _feed(ctl, 0.0, 0.01, 0.05)  # verification far costlier
    assert ctl.draft_len(512) == 3


def test_draft_cost_is_taken_from_the_first_measurement():
    """A costly draft (here one draft step = 0.9 of a target step) must count from the
    first steps on, not creep up from zero while speculation keeps losing."""
    ctl = SpecController(4, prior_acceptance=0.95)
    _feed(ctl, 0.03, 0.002, 0.002)
    ctl.draft_len(64)
    ctl.last_k = 4
    t_off = ctl.step_time_model().off(64)
    ctl.observe_draft(64, 4 * 0.9 * t_off, 1.0, 64)
    assert abs(ctl.draft_ratio - 0.9) < 1e-6
    assert ctl.draft_len(64) == 0  # 4 draft steps cost more than the accepted tokens save
