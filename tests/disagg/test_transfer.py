"""The transfer state machine between a prefill engine and a decode engine (FakeRunners,
inproc transport, a moved clock): correct tokens, dedup, and every fault's outcome."""

import pytest

from servelm.disagg.transport import InProcTransport
from tests.disagg.faults import FaultyTransport, Plan
from tests.disagg.harness import BLOCK, POISON, Pair, colocated, prompt, request


def _expect(pair, rid, tokens, max_tokens=6):
    want = colocated([(tokens, max_tokens)])[0]
    assert pair.outputs[rid] == want
    assert POISON not in pair.outputs[rid]


def test_blocks_move_and_decode_computes_only_the_tail():
    pair = Pair()
    tokens = prompt(4 * BLOCK + 3)  # 4 full blocks + 3 tokens
    rid = pair.submit(tokens)
    pair.run()
    _expect(pair, rid, tokens)
    d, p = pair.d_role.stats, pair.p_role.stats
    assert d.num_completed == 1 and p.num_completed == 1 and not d.fallbacks
    assert d.num_blocks == 4 and d.num_bytes == 4 * 8 * BLOCK
    assert p.num_bytes == d.num_bytes
    # decode computed the 3 tail tokens and its decodes, never the transferred prompt
    assert pair.decode.stats.num_computed_prompt_tokens == 3
    assert pair.decode.runner.num_bad_reads == 0
    pair.check_clean()


def test_blocks_cross_while_the_prompt_is_computed():
    pair = Pair()
    tokens = prompt(25 * BLOCK + 1)  # four prefill chunks of 32 tokens
    rid = pair.submit(tokens)
    loaded_while_computing = []
    while pair.prefill.num_requests:
        pair.step()
        loaded_while_computing.append(sum(len(t.loaded)
                                          for t in pair.d_role._transfers.values()))
    # blocks of the first chunks were in the decode pool before the last chunk ran
    assert len(loaded_while_computing) >= 4 and 0 < loaded_while_computing[-2] < 25
    pair.run()
    _expect(pair, rid, tokens)
    assert pair.d_role.stats.num_completed == 1
    pair.check_clean()


def test_block_multiple_prompt_keeps_one_token_to_compute():
    pair = Pair()
    tokens = prompt(3 * BLOCK)
    rid = pair.submit(tokens)
    pair.run()
    _expect(pair, rid, tokens)
    assert pair.d_role.stats.num_blocks == 2  # the last block holds the token decode runs
    assert pair.decode.stats.num_computed_prompt_tokens == BLOCK
    pair.check_clean()


def test_blocks_decode_already_holds_are_not_sent():
    pair = Pair()
    shared = prompt(3 * BLOCK, seed=1)
    first = pair.submit(shared + prompt(2 * BLOCK, seed=2))
    pair.run()
    sent_before = pair.p_role.stats.num_blocks
    second_tokens = shared + prompt(2 * BLOCK + 1, seed=3)
    second = pair.submit(second_tokens)
    pair.run()
    _expect(pair, second, second_tokens)
    assert pair.outputs[first]
    assert pair.d_role.stats.num_blocks_deduped == 3
    assert pair.p_role.stats.num_blocks - sent_before == 2  # only the new full blocks
    pair.check_clean()


def test_many_requests_interleaved_with_chunked_prefill():
    pair = Pair(num_blocks=128)
    reqs = [(prompt(BLOCK * (3 + i) + i % BLOCK, seed=10 + i), 4 + i) for i in range(6)]
    rids = [pair.submit(t, m) for t, m in reqs]
    pair.run()
    want = colocated(reqs)
    assert [pair.outputs[r] for r in rids] == want
    assert pair.d_role.stats.num_completed == 6
    pair.check_clean()


def test_n_continuations_share_the_imported_prompt():
    pair = Pair()
    tokens = prompt(3 * BLOCK + 1)
    rid = pair.submit(tokens, 5, n=2, seed=7)
    pair.run()
    assert len(pair.outputs[rid]) == 10
    assert pair.d_role.stats.num_completed == 1
    pair.check_clean()


@pytest.mark.parametrize("action,which,cause", [
    ("drop", (1,), "frame_lost"),
    ("corrupt", (2,), "checksum"),
    ("duplicate", (0, 1, 2, 3), None),
])
def test_frame_faults(action, which, cause):
    faulty = FaultyTransport(InProcTransport(), [Plan("KVFrame", action, which)])
    pair = Pair(decode_transport=faulty)
    tokens = prompt(5 * BLOCK + 2)
    rid = pair.submit(tokens)
    pair.run()
    _expect(pair, rid, tokens)
    assert faulty.num_faults >= 1
    d = pair.d_role.stats
    if cause is None:
        assert d.num_completed == 1 and d.num_duplicate_frames == 4
    else:
        assert d.fallbacks == {cause: 1}
        assert d.num_blocks == min(which)  # the verified prefix before the bad frame is kept
        # decode computed from the bad block on
        assert pair.decode.stats.num_computed_prompt_tokens == len(tokens) - BLOCK * min(which)
    assert pair.decode.runner.num_bad_reads == 0
    pair.check_clean()


def test_delayed_frames_within_the_lease_are_used():
    faulty = FaultyTransport(InProcTransport(), [Plan("KVFrame", "hold", range(100)),
                                                 Plan("Sent", "hold", range(100))])
    pair = Pair(decode_transport=faulty)
    tokens = prompt(4 * BLOCK + 1)
    rid = pair.submit(tokens)
    pair.run(until=lambda: any(type(m[1]).__name__ == "Sent" for m in faulty.endpoints[0].held))
    for _ in range(5):
        pair.step()
    assert pair.d_role.stats.num_finished == 0  # waiting for the held frames
    faulty.release()  # they arrive late (in order: every transport keeps it)
    pair.run()
    _expect(pair, rid, tokens)
    assert pair.d_role.stats.num_completed == 1
    pair.check_clean()


def test_frames_later_than_the_lease_fall_back_and_are_ignored():
    faulty = FaultyTransport(InProcTransport(), [Plan("KVFrame", "hold", range(100)),
                                                 Plan("Sent", "hold", range(100))])
    pair = Pair(decode_transport=faulty)
    tokens = prompt(4 * BLOCK + 1)
    rid = pair.submit(tokens)
    pair.run(until=lambda: rid in pair.finished, dt=0.5)  # the lease (5 s) runs out
    _expect(pair, rid, tokens)
    assert pair.d_role.stats.fallbacks == {"lease_expired": 1}
    assert pair.d_role.stats.num_lease_expiries == 1
    faulty.release()
    pair.run()
    assert pair.d_role.stats.num_late_messages >= 4
    pair.check_clean()


def test_lease_expiry_racing_the_ack():
    """The Ack is delayed past the prefill side's deadline: prefill frees on expiry, the late
    Ack is ignored, decode (which holds its own verified copy) is unaffected."""
    faulty = FaultyTransport(InProcTransport(), [Plan("Ack", "hold", (0,))])
    pair = Pair(transport=faulty)  # the prefill side's listener is wrapped
    tokens = prompt(4 * BLOCK + 1)
    rid = pair.submit(tokens)
    pair.run(until=lambda: rid in pair.finished)
    assert pair.prefill.block_manager.num_pinned_blocks == 4  # still waiting for the Ack
    pair.run(dt=0.5)  # past lease + grace
    assert pair.p_role.stats.num_lease_expiries == 1
    assert pair.prefill.block_manager.num_pinned_blocks == 0
    faulty.release()  # the Ack arrives after the expiry
    pair.run()
    pair.prefill.step()
    assert pair.p_role.stats.num_late_messages == 1
    _expect(pair, rid, tokens)
    pair.check_clean()


def test_prefill_dies_mid_transfer():
    pair = Pair()
    tokens = prompt(20 * BLOCK + 1)  # three prefill chunks: blocks arrive chunk by chunk
    rid = pair.submit(tokens)
    pair.run(until=lambda: any(t.loaded for t in pair.d_role._transfers.values()))
    assert pair.prefill.num_requests == 1  # still computing
    channel = next(iter(pair.d_role._channels.values()))
    pair.prefill_alive = False
    channel.close("prefill worker died")
    pair.run()
    _expect(pair, rid, tokens)
    assert pair.d_role.stats.fallbacks == {"peer_lost": 1}
    pair.check_clean()


def test_prefill_never_answers_then_the_lease_bounds_the_wait():
    pair = Pair()
    pair.prefill_alive = False  # up, but never steps: no frame will come
    tokens = prompt(4 * BLOCK + 2)
    rid = pair.submit(tokens)
    pair.run(dt=0.5)
    _expect(pair, rid, tokens)
    assert pair.d_role.stats.fallbacks == {"lease_expired": 1}
    pair.check_clean()


def test_decode_dies_mid_transfer():
    faulty = FaultyTransport(InProcTransport(), [Plan("KVFrame", "hold", range(100))])
    pair = Pair(decode_transport=faulty)
    pair.submit(prompt(5 * BLOCK + 1))
    pair.run(until=lambda: pair.prefill.num_requests == 0 and pair.p_role.stats.num_started)
    assert pair.prefill.block_manager.num_pinned_blocks > 0
    pair.decode_alive = False
    next(iter(pair.d_role._channels.values())).close("decode worker died")
    pair.run()
    assert pair.p_role.stats.fallbacks == {"cancelled": 1}
    pair.check_clean()  # the prefill side let go of every block


def test_decode_dies_mid_decode():
    pair = Pair()
    rid = pair.submit(prompt(4 * BLOCK + 1), max_tokens=50)
    pair.run(until=lambda: len(pair.outputs[rid]) >= 3)
    assert pair.p_role.stats.num_completed == 1  # acked before decoding
    pair.decode_alive = False
    next(iter(pair.d_role._channels.values())).close("decode worker died")
    pair.run()
    pair.check_clean()


def test_decode_silent_after_pull_prefill_lease_expires():
    faulty = FaultyTransport(InProcTransport(), [Plan("Ack", "drop", (0,))])
    pair = Pair(transport=faulty)
    tokens = prompt(4 * BLOCK + 1)
    rid = pair.submit(tokens)
    pair.run(dt=0.5)
    _expect(pair, rid, tokens)
    assert pair.p_role.stats.num_lease_expiries == 1
    pair.check_clean()


def test_abort_while_waiting_for_kv():
    faulty = FaultyTransport(InProcTransport(), [Plan("KVFrame", "hold", range(100)),
                                                 Plan("Sent", "hold", range(100))])
    pair = Pair(decode_transport=faulty)
    rid = pair.submit(prompt(4 * BLOCK + 1))
    pair.run(until=lambda: any(type(m[1]).__name__ == "Sent" for m in faulty.endpoints[0].held))
    assert pair.decode.abort(rid)
    pair.run()
    assert pair.finished[rid] == "abort"
    assert pair.d_role.stats.fallbacks == {"aborted": 1}
    faulty.release()
    pair.run()
    pair.check_clean()


def test_no_room_to_reserve_falls_back_at_once():
    pair = Pair(decode_blocks=12)
    busy = request(prompt(6 * BLOCK, seed=5), max_tokens=8)
    pair.decode.add_request(busy)  # holds 7 blocks while it runs
    pair.outputs[busy.request_id] = []
    pair.step()
    tokens = prompt(6 * BLOCK + 1)
    rid = pair.submit(tokens, max_tokens=2)
    pair.run()
    _expect(pair, rid, tokens, 2)
    assert pair.d_role.stats.fallbacks == {"no_blocks": 1}
    pair.check_clean()


def test_prompt_logprobs_are_computed_locally():
    pair = Pair()
    tokens = prompt(4 * BLOCK + 1)
    pair.submit(tokens, prompt_logprobs=0)
    pair.run()
    assert pair.d_role.stats.fallbacks == {"prompt_states": 1}
    pair.check_clean()
