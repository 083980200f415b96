"""SpecController: speculation on at small batch, off past the break-even batch, back on
when the batch shrinks, all from measured step times and acceptance."""

from servelm.planner.speculative import expected_tokens_per_step
from servelm.spec import SpecController


def _feed(ctl, c0, c1, sizes):
    for n in sizes:
        ctl.observe_step(n, c0 + c1 * n)


def test_explores_with_k_max_until_step_times_spread():
    ctl = SpecController(4)
    assert ctl.draft_len(8) == 4  # nothing measured yet
    _feed(ctl, 0.05, 0.001, [8] * 10)  # one size only: slope unknown
    assert ctl.step_time_model() is None and ctl.draft_len(8) == 4


def test_switches_off_past_break_even_and_back_on():
    # A memory-bound CPU-like step: 50 ms fixed + 2 ms per token; acceptance 0.7.
    ctl = SpecController(4, prior_acceptance=0.7)
    _feed(ctl, 0.05, 0.002, [1, 5, 4, 20, 64, 320, 16, 80] * 4)
    c0, c1 = ctl.step_time_model()
    assert abs(c0 - 0.05) < 1e-6 and abs(c1 - 0.002) < 1e-8
    assert ctl.draft_len(1) >= 3  # the step costs ~the same for 1 or 5 tokens
    assert ctl.draft_len(256) == 0  # compute-bound: each rejected draft is paid for
    assert ctl.num_off_steps == 1
    assert ctl.draft_len(2) > 0  # the batch shrank: back on
    be = ctl.break_even_batch()
    assert 1 < be < 256
    # At the break-even batch the best k is 0, just below it speculation still pays.
    assert ctl._best_k(be) == 0 and ctl._best_k(be - 1) > 0


def test_break_even_matches_the_formula():
    """rate(k) vs rate(0) at batch B by hand, with E from the planner."""
    ctl = SpecController(2, prior_acceptance=0.5)
    _feed(ctl, 0.1, 0.01, [1, 3, 10, 30] * 4)
    a, t = 0.5, (lambda n: 0.1 + 0.01 * n)
    for b in (1, 4, 16, 64):
        rates = [b / t(b)] + [b * expected_tokens_per_step(a, k) / t(b * (1 + k))
                              for k in (1, 2)]
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
        _feed(ctl, 0.05, 0.002, [1, 5, 16, 80, 64, 320] * 4)
    costly.draft_ratio = 0.5  # each draft step costs half a target step
    assert costly.break_even_batch() < cheap.break_even_batch()


def test_not_adaptive_always_speculates():
    ctl = SpecController(3, adaptive=False)
    _feed(ctl, 0.0, 0.01, [1, 100] * 8)  # purely compute-bound
    assert ctl.draft_len(512) == 3
