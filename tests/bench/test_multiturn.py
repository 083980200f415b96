"""`servelm bench multiturn`: the conversation workload, the session-driven load (against the
fake server: think time between a reply and the next turn, one `user` per conversation), and
the hit-rate and imbalance arithmetic over the servers' counters."""

from __future__ import annotations

import asyncio
import json

import pytest

from servelm.bench.fake_server import FakeBehaviour, FakeServer
from servelm.bench.loadgen import EndpointConfig
from servelm.bench.multiturn import (cache_and_balance, multi_turn, run_conversations_async,
                                     server_counters)
from servelm.bench.workloads import RangeError


def test_turns_share_the_system_prompt_and_extend_their_history():
    convs = multi_turn(6, system_len=40, user_len=(5, 9), output_len=(3, 4), turns=(2, 4),
                       vocab_size=1000, seed=3)
    assert len(convs) == 6 and len({c.session for c in convs}) == 6
    system = convs[0].turns[0].prompt_token_ids[:40]
    for c in convs:
        assert 2 <= len(c.turns) <= 4
        prev = None
        for t in c.turns:
            assert t.prompt_token_ids[:40] == system
            assert 3 <= t.max_tokens <= 4
            if prev is not None:  # previous prompt + its answer (3-4) + this user turn (5-9)
                assert t.prompt_token_ids[:len(prev.prompt_token_ids)] == prev.prompt_token_ids
                grown = len(t.prompt_token_ids) - len(prev.prompt_token_ids)
                assert prev.max_tokens + 5 <= grown <= prev.max_tokens + 9
            prev = t
    # Conversations differ after the system prompt; the same seed gives the same workload.
    assert convs[0].turns[0].prompt_token_ids != convs[1].turns[0].prompt_token_ids
    assert multi_turn(6, 40, (5, 9), (3, 4), (2, 4), vocab_size=1000, seed=3) == convs


def test_bad_workload_arguments_name_the_parameter():
    with pytest.raises(RangeError) as e:
        multi_turn(0, vocab_size=1000)
    assert e.value.param == "num_conversations"
    with pytest.raises(RangeError) as e:
        multi_turn(2, turns="4:2", vocab_size=1000)
    assert e.value.param == "turns"


def test_next_turn_waits_for_the_reply_and_the_think_time():
    convs = multi_turn(3, system_len=8, user_len=4, output_len=3, turns=3, vocab_size=1000,
                       seed=0)
    behaviour = FakeBehaviour(ttft_s=0.05, tpot_s=0.01)
    with FakeServer(behaviour) as srv:
        cfg = EndpointConfig(srv.url, "m")
        turns, elapsed, _ = asyncio.run(run_conversations_async(cfg, convs, rate=50.0,
                                                                think_time_s=0.2, seed=1))
        received = srv.received
    assert len(turns) == 9 and all(t.record.is_ok for t in turns)
    assert sorted(u for _, u, _ in received) == sorted(c.session for c in convs for _ in range(3))
    for i, c in enumerate(convs):
        mine = sorted((t for t in turns if t.conversation == i), key=lambda t: t.turn)
        # each turn is sent after the previous reply ended (plus a think time)
        for a, b in zip(mine, mine[1:]):
            assert b.record.sent_time >= a.record.end_time
        lens = [n for _, u, n in received if u == c.session]
        assert lens == [len(t.prompt_token_ids) for t in c.turns]  # in order, whole history
    # 3 turns of ~0.08 s each plus two exponential think times of mean 0.2 s per
    # conversation: the run cannot be shorter than the turns themselves.
    assert elapsed >= 3 * 0.07


def test_hit_rate_and_imbalance_from_two_snapshots():
    before = {"a": {"hit_tokens": 100, "prompt_tokens": 1000, "routed": 10},
              "b": {"hit_tokens": 0, "prompt_tokens": 200, "routed": 2}}
    after = {"a": {"hit_tokens": 700, "prompt_tokens": 2000, "routed": 16},
             "b": {"hit_tokens": 300, "prompt_tokens": 1200, "routed": 6}}
    out = cache_and_balance(before, after)
    # (600 + 300) hit of (1000 + 1000) prompt tokens; requests 6 and 4 -> max 6 / mean 5
    assert out["prefix_hit_rate"] == pytest.approx(0.45)
    assert out["imbalance_requests"] == pytest.approx(1.2)
    assert out["imbalance_prompt_tokens"] == pytest.approx(1.0)
    assert out["replicas"]["b"] == {"hit_tokens": 300, "prompt_tokens": 1000, "routed": 4}


def test_counters_read_from_a_router_page_and_from_one_server(monkeypatch):
    import httpx

    pages = {
        "router": 'servelm_router_requests_total{replica="http://r1"} 4.0\n'
                  'servelm_router_requests_total{replica="http://r2"} 2.0\n'
                  'servelm_router_replica_reported_hit_tokens{replica="http://r1"} 64.0\n'
                  'servelm_router_replica_reported_prompt_tokens{replica="http://r1"} 300.0\n',
        "server": "servelm_prompt_tokens_total 500.0\n"
                  "servelm_prefix_cache_hit_tokens_total 128.0\n"
                  'servelm_requests_finished_total{reason="length"} 3.0\n'
                  'servelm_requests_finished_total{reason="stop"} 2.0\n',
        "other": "vllm_whatever 1\n"}

    def fake_get(url, **kw):
        return httpx.Response(200, text=pages[url.split("//")[1].split("/")[0]])

    monkeypatch.setattr(httpx, "get", fake_get)
    r = server_counters(EndpointConfig("http://router", "m"))
    assert r == {"http://r1": {"routed": 4.0, "hit_tokens": 64.0, "prompt_tokens": 300.0},
                 "http://r2": {"routed": 2.0}}
    s = server_counters(EndpointConfig("http://server/v1", "m"))
    assert s == {"self": {"hit_tokens": 128.0, "prompt_tokens": 500.0, "routed": 5.0}}
    assert server_counters(EndpointConfig("http://other", "m")) == {}
