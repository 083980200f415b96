"""Faults drawn at random (hypothesis, seeded and replayable): several transfers at once,
messages of every kind dropped, duplicated, corrupted or held and released late, a worker
dying at any step. Whatever happens: every answer the decode worker gives is the colocated
engine's, nothing is stuck (every request ends within a bound), and no block, pin or
sequence is left on a side that is alive."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelm.disagg.transport import InProcTransport
from tests.disagg.faults import FaultyTransport, Plan
from tests.disagg.harness import BLOCK, POISON, Pair, colocated, prompt

KINDS = ("Pull", "KVFrame", "Sent", "Ack", "Cancel")
ACTIONS = ("drop", "duplicate", "hold")

plans = st.lists(st.builds(
    Plan,
    st.sampled_from(KINDS),
    st.sampled_from(ACTIONS),
    st.lists(st.integers(0, 6), min_size=1, max_size=3)), max_size=4)
corrupt = st.lists(st.integers(0, 12), max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(to_decode=plans, to_prefill=plans, corrupted=corrupt,
       lens=st.lists(st.integers(1, 14 * BLOCK), min_size=1, max_size=4),
       release_at=st.integers(0, 40), death=st.sampled_from(["none", "prefill", "decode"]),
       death_at=st.integers(0, 30))
def test_random_faults(to_decode, to_prefill, corrupted, lens, release_at, death, death_at):
    d_faults = FaultyTransport(InProcTransport(), to_decode + [
        Plan("KVFrame", "corrupt", corrupted)])
    p_faults = FaultyTransport(InProcTransport(), to_prefill)
    pair = Pair(transport=p_faults, decode_transport=d_faults)
    reqs = [(prompt(n, seed=i), 3 + i) for i, n in enumerate(lens)]
    rids = [pair.submit(t, m) for t, m in reqs]
    for step in range(60):
        if step == release_at:
            d_faults.release()
            p_faults.release()
        if step == death_at and death != "none":
            _kill(pair, death)
        pair.step(dt=0.25)
    d_faults.release()
    p_faults.release()
    pair.run(max_steps=400, dt=0.25)  # past every lease: a request still open is stuck
    want = colocated(reqs)
    for rid, expected in zip(rids, want):
        if pair.decode_alive:
            assert pair.outputs[rid] == expected, (rid, pair.d_role.stats)
        assert POISON not in pair.outputs[rid]
    pair.check_clean()


def _kill(pair: Pair, side: str) -> None:
    """The side stops stepping and its channels close, as a dead process's would."""
    if side == "prefill":
        pair.prefill_alive = False
    else:
        pair.decode_alive = False
    for ch in list(pair.d_role._channels.values()):
        ch.close("worker died")
