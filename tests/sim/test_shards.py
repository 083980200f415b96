"""A fleet run split over processes (servelm/sim/shards.py) is the one-process run: the same
records, step counts, per-replica reports and ITL summary, through prefix-cache hits, the
restart at a preemption, and the SLO policy's early rejections; a shard that fails stops
the others and its error reaches the caller."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from servelm.bench.metrics import summarize
from servelm.router.policies import make_policy
from servelm.sim import shards
from servelm.sim.fleet import ReplicaSpec, SimRequest, simulate
from servelm.sim.itl import ITLSummary
from servelm.slo import SLOSpec
from test_bulk import COST, _record_key

pytestmark = pytest.mark.skipif(not shards.can_shard(make_policy("least_loaded")),
                                reason="sharding needs fork() on x86-64")

SPEC = ReplicaSpec(num_blocks=4000, block_size=16, max_num_seqs=24,
                   max_num_batched_tokens=512, max_model_len=2048, vocab_size=1000)


def _requests(n, seed, shared_every=0, span=4.0, output=(1, 64)):
    """Random prompts; every shared_every-th one starts with a common 48-token prefix (the
    prefix caches then matter, and least_loaded still ignores them)."""
    rng = random.Random(seed)
    common = [rng.randrange(100, 1000) for _ in range(48)]
    out = []
    for i in range(n):
        ids = [rng.randrange(100, 1000) for _ in range(rng.randint(16, 600))]
        if shared_every and i % shared_every == 0:
            ids = common + ids
        out.append(SimRequest(rng.uniform(0, span), ids, rng.randint(*output)))
    return out


def _same(one, split) -> None:
    assert split.num_shards > 1 and one.num_shards == 1 and not split.replicas
    assert list(map(_record_key, one.records)) == list(map(_record_key, split.records))
    assert [(r.error, r.error_detail) for r in one.records] == \
        [(r.error, r.error_detail) for r in split.records]
    assert (one.num_steps, one.num_bulk_steps, one.num_mixed_steps, one.elapsed_s) == \
        (split.num_steps, split.num_bulk_steps, split.num_mixed_steps, split.elapsed_s)
    assert one.replica_reports == split.replica_reports
    if one.itl is not None:
        assert one.itl.summary_ms() == split.itl.summary_ms()


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("keep_chunk_times", [True, False])
def test_a_sharded_run_is_the_one_process_run(num_shards, keep_chunk_times):
    reqs = _requests(400, 1, shared_every=3)
    one = simulate(reqs, 7, SPEC, COST, make_policy("least_loaded"),
                   keep_chunk_times=keep_chunk_times)
    split = simulate(reqs, 7, SPEC, COST, make_policy("least_loaded"),
                     keep_chunk_times=keep_chunk_times, shards=num_shards)
    _same(one, split)
    assert split.num_shards == num_shards
    assert sum(r.prefix_hit_tokens for r in split.replica_reports) > 0  # caches were hit
    assert len({r.index for r in split.replica_reports}) == 7
    assert all(r.num_requests for r in split.replica_reports)  # every shard admitted some
    assert len(split.shard_max_rss_mb) == num_shards


def test_a_preemption_in_one_shard_restarts_every_shard_with_caches():
    spec = ReplicaSpec(num_blocks=96, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=256, max_model_len=2048, vocab_size=1000)
    reqs = _requests(200, 0, span=5.0)  # distinct first blocks: tried without caches first
    one = simulate(reqs, 3, spec, COST, make_policy("least_loaded"))
    split = simulate(reqs, 3, spec, COST, make_policy("least_loaded"), shards=2)
    _same(one, split)
    assert sum(r.num_preemptions for r in split.replica_reports) > 0
    assert sum(r.prefix_query_tokens for r in split.replica_reports) > 0  # ran with caches


def test_the_slo_policy_rejects_the_same_requests_sharded():
    spec_slo = SLOSpec.from_dict({"classes": [
        {"name": "interactive", "priority": 0, "ttft_ms": 150, "tpot_ms": 40},
        {"name": "batch", "priority": 1, "ttft_ms": 20000, "tpot_ms": 400,
         "reject_early": False}], "default_class": "interactive"})
    reqs = _requests(300, 4, span=1.5)
    for i, r in enumerate(reqs):
        r.slo = spec_slo.get("interactive" if i % 3 else "batch").request_slo()
    spec = ReplicaSpec(num_blocks=2000, block_size=16, max_num_seqs=16,
                       max_num_batched_tokens=256, max_model_len=2048, vocab_size=1000,
                       scheduling_policy="slo")
    one = simulate(reqs, 4, spec, COST, make_policy("least_loaded"))
    split = simulate(reqs, 4, spec, COST, make_policy("least_loaded"), shards=2)
    _same(one, split)
    assert any(r.error == "slo_unattainable" for r in split.records)


def test_a_policy_that_cannot_be_sharded_runs_in_one_process():
    reqs = _requests(60, 2)
    for name in ("round_robin", "prefix_affinity"):
        assert not shards.can_shard(make_policy(name))
        sim = simulate(reqs, 3, SPEC, COST, make_policy(name), shards=2)
        assert sim.num_shards == 1 and len(sim.replicas) == 3


def test_a_failing_shard_stops_the_others_and_its_error_is_raised(monkeypatch):
    reqs = _requests(300, 3)
    late = SimRequest(reqs[0].arrival_s, [101] * 20, 2)  # sorted: the stream goes back
    stream = sorted(reqs, key=lambda r: r.arrival_s)
    with pytest.raises(ValueError, match="arrival order"):
        simulate(iter(stream[:100] + [late] + stream[100:]), 4, SPEC, COST,
                 make_policy("least_loaded"), shards=2)
    real = shards._admit

    def admit(rid, *args):  # the fork copies this: shard 1's 50th arrival it admits fails
        if rid == "r150" and os.getpid() != parent:
            raise KeyError("a bug in a shard")
        return real(rid, *args)

    parent = os.getpid()
    monkeypatch.setattr(shards, "_admit", admit)
    with pytest.raises(RuntimeError, match="a bug in a shard"):
        simulate(reqs, 4, SPEC, COST, make_policy("least_loaded"), shards=2)

    def dies(rid, *args):
        if rid == "r150" and os.getpid() != parent:
            os._exit(3)  # killed: no word back, only the pipe's end
        return real(rid, *args)

    monkeypatch.setattr(shards, "_admit", dies)
    with pytest.raises(RuntimeError, match=r"exited \(code 3\) without a result"):
        simulate(reqs, 4, SPEC, COST, make_policy("least_loaded"), shards=2)


@pytest.mark.parametrize("limit", [10**6, 3000, 10])
def test_itl_summaries_of_parts_merge_into_the_whole_ones(limit):
    rng = np.random.default_rng(7)
    gaps = rng.exponential(0.03, 9000) * rng.choice([1.0, 1e-3, 50.0], 9000)
    whole, parts = ITLSummary(limit), [ITLSummary(limit) for _ in range(3)]
    for i in range(0, len(gaps), 250):
        whole.add_weighted(gaps[i:i + 250], np.ones(250, dtype=np.int64))
        parts[i // 250 % 3].add_weighted(gaps[i:i + 250], np.ones(250, dtype=np.int64))
    merged = ITLSummary.from_bytes(parts[2].to_bytes())
    for part in parts[:2]:
        merged.merge(ITLSummary.from_bytes(part.to_bytes()))
    assert merged.summary_ms() == whole.summary_ms()
    assert merged.binned == (limit < len(gaps))
    exact = summarize(gaps.tolist(), 1e3)
    assert whole.summary_ms()["mean"] == pytest.approx(exact["mean"], rel=1e-15)


def test_the_cli_gives_the_same_result_sharded(tmp_path, capsys):
    from servelm.cli import main

    outs = []
    for n in ("1", "2"):
        out = tmp_path / f"s{n}.json"
        main(["sim", "--gpu", "H100-SXM", "--model", "Llama-3.1-8B", "--policy",
              "least_loaded", "--num-replicas", "6", "--request-rate", "60",
              "--num-prompts", "300", "--input-len", "400", "--output-len", "60",
              "--shards", n, "--out", str(out)])
        outs.append(json.loads(out.read_text()))
    one, split = outs
    assert (one["sim"]["num_shards"], split["sim"]["num_shards"]) == (1, 2)
    for r in outs:  # what differs: the wall clock, the memory, the command line, and the
        # machine's state as each run found it (load average, free memory)
        for key in ("wall_s", "simulated_requests_per_wall_s", "max_rss_mb", "num_shards"):
            r["sim"].pop(key)
        r.pop("command")
        r.pop("machine")
    assert one == split
    capsys.readouterr()
    assert main(["sim", "--gpu", "H100-SXM", "--model", "Llama-3.1-8B", "--policy",
                 "least_loaded", "--request-rate", "1", "--num-prompts", "2",
                 "--shards", "0"]) == 2
    assert "--shards: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("with_post", [True, False])
def test_between_posting_and_settling_an_arrival_a_shard_runs_its_other_replicas_steps(
        with_post):
    """_event_loop's `post` (the shards' loop): when arrival j is settled, no replica but
    the one post named has a step left that starts before arrival j + 1; without `post`,
    the loop leaves them for after (the check can fail)."""
    from servelm.sim.fleet import _admit, _event_loop, _make_replica
    replicas = [_make_replica(i, SPEC, COST) for i in range(3)]
    records: dict = {}
    rng = random.Random(5)
    reqs = [SimRequest(0.02 * i, [rng.randrange(100, 1000) for _ in range(40)], 30)
            for i in range(60)]
    lag = 0.0
    named: list = [None]
    early: list[int] = []

    def post(j, req):
        named[0] = replicas[j % 3]
        return named[0]

    def arrive(j, req, steps, order):
        horizon = reqs[j + 1].arrival_s + lag if j + 1 < len(reqs) else float("inf")
        if any(t < horizon for t, _, rep in steps if rep is not named[0]):
            early.append(j)
        _admit(f"r{j}", req, replicas[j % 3], records, steps, order, lag)

    if not with_post:
        def arrive_named(j, req, steps, order):
            named[0] = replicas[j % 3]
            arrive(j, req, steps, order)
    _event_loop(reqs, arrive if with_post else arrive_named, lag, records, True, None, None,
                report=False, post=post if with_post else None)
    assert len(records) == 60 and all(r.end_time is not None for r in records.values())
    assert (early == []) if with_post else len(early) > 10
