"""The doctor's attribution on hand-made records: a tail request's queue time spent while the
KV pool was full is the pool's (preemption's), even when the request also arrived in a burst;
the same burst with a pool that had room is queueing's, and so is a later arrival that found
the burst's backlog still waiting."""

from __future__ import annotations

from servelm.doctor import diagnose
from servelm.server.dashboard.records import RequestRecord


def _records(kv_full_share: float, late: int = 0) -> list[RequestRecord]:
    out = []
    for i in range(60):  # the body: spread out, 30 ms to first token, 5 ms of it queued
        out.append(RequestRecord(f"b{i}", "completions", "ok", False, arrival=i * 0.5,
                                 arrival_unix=i * 0.5, num_prompt_tokens=24,
                                 num_output_tokens=8, queue_s=0.005, prefill_s=0.01,
                                 ttft_s=0.03))
    for i in range(6):  # the tail: a burst at t=40 s, 90 ms queued
        queued = 0.09
        out.append(RequestRecord(f"t{i}", "completions", "ok", False, arrival=40.0 + i * 1e-3,
                                 arrival_unix=40.0, num_prompt_tokens=24, num_output_tokens=8,
                                 queue_s=queued, queue_kv_full_s=kv_full_share * queued,
                                 prefill_s=0.01, ttft_s=0.12))
    for i in range(late):  # alone, after the burst, behind 5 of it still waiting: the slowest
        out.append(RequestRecord(f"l{i}", "completions", "ok", False, arrival=40.3 + i * 0.1,
                                 arrival_unix=40.3, num_prompt_tokens=24, num_output_tokens=8,
                                 queue_s=0.12, prefill_s=0.01, ttft_s=0.15,
                                 num_waiting_at_arrival=5))
    return out


def test_queue_while_the_pool_is_full_is_named_preemption():
    d = diagnose(_records(kv_full_share=0.9))
    by_name = {s.name: s for s in d.suspects}
    assert d.suspects[0].name == "preemption", [s.to_dict() for s in d.suspects]
    # the burst's own share is only the 10% of the queue the pool had room for
    assert by_name["queueing"].tail_share == 1.0
    assert by_name["queueing"].score < 0.2


def test_the_same_burst_with_room_in_the_pool_is_named_queueing():
    d = diagnose(_records(kv_full_share=0.0))
    assert d.suspects[0].name == "queueing", [s.to_dict() for s in d.suspects]
    assert d.suspects[0].score > 0.8


def test_a_later_arrival_behind_the_bursts_backlog_is_queueings_too():
    d = diagnose(_records(kv_full_share=0.0, late=3))
    top = d.suspects[0]
    assert top.name == "queueing", [s.to_dict() for s in d.suspects]
    assert d.num_tail == 5  # the three late ones and two of the burst
    assert top.tail_share == 1.0 and top.score > 0.8
    assert "5 were waiting when they arrived (body 0)" in top.evidence  # the tail median
