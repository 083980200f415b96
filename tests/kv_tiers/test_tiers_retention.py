"""prompt_cache_retention below the device pool: a retained block the pool evicts all the same
is kept in host memory ahead of every other block until its retention ends, within the same
per-tenant cap as in the pool."""

import random
from types import SimpleNamespace

from fake_runner import FakeRunner
from tiers_helpers import CheckingRunner, explain

from servelm.engine.block_manager import BlockManager
from servelm.engine.retention_book import Retention
from servelm.kv_tiers.entry import make_entry
from servelm.kv_tiers.host_tier import HostTier
from servelm.kv_tiers.io_queue import IOQueue
from servelm.kv_tiers.tiers import KVTiers
from servelm.protocol import EngineRequest, SamplingParams

BLOCK = 4
NBYTES = 8 * BLOCK  # the fake runner's block


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _prompt(seed, n=40):
    rng = random.Random(seed)
    return [rng.randrange(10, 900) for _ in range(n)]


def _engine(clock, host_blocks=12, num_blocks=16, cap=64):
    from servelm.config import SchedulerConfig
    from servelm.engine.engine import Engine

    runner = CheckingRunner(BLOCK)
    kv = KVTiers([HostTier(host_blocks * NBYTES)], BLOCK, runner.block_nbytes, "always",
                 io=IOQueue(threaded=False))
    engine = Engine(runner, None, BlockManager(num_blocks, BLOCK, True, max_retained_blocks=cap,
                                               clock=clock),
                    SchedulerConfig(32, 1, True), 512, 1000, (1,), kv_connector=kv)
    return engine, kv


def _run(engine, rid, prompt, retention=None):
    engine.add_request(EngineRequest(rid, prompt, SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, prompt_cache_retention=retention)))
    timings = None
    while engine.has_unfinished:
        for d in engine.step():
            if d.timings is not None:
                timings = d.timings
        engine.check_invariants()
    return timings


def _flush(engine, seeds):
    for s in seeds:  # one at a time: each takes 15 of the pool's 16 blocks
        _run(engine, f"flush{s}", _prompt(s, 56))


def test_a_retained_prefix_stays_in_host_memory_under_pressure_that_drops_others():
    clock = _Clock()
    engine, kv = _engine(clock)
    kept, lost = _prompt(1), _prompt(2)
    _run(engine, "kept", kept, "24h")
    _run(engine, "lost", lost)
    _flush(engine, [3, 4, 5])  # device and host pressure: 45 blocks through a host of 12
    host = kv.by_name["host"]
    assert host.num_kept == kv.num_retained_blocks >= 9
    ex = explain(_run(engine, "kept'", kept))
    # all 9 full blocks found (one token is always computed), most of them in host memory
    assert ex["device_tokens"] + ex["host_tokens"] == 36 and ex["host_tokens"] >= 32
    ex = explain(_run(engine, "lost'", lost))
    assert ex.get("device_tokens", 0) == ex.get("host_tokens", 0) == 0
    kv.check_invariants()


def test_expiry_releases_a_retained_prefix_in_host_memory():
    clock = _Clock()
    engine, kv = _engine(clock)
    kept = _prompt(1)
    _run(engine, "kept", kept, "24h")
    _flush(engine, [3, 4])
    assert kv.by_name["host"].num_kept >= 9
    clock.now += 24 * 3600 + 1
    _flush(engine, [5, 6, 7])  # the step's poll ends the retention: plain LRU again
    assert kv.by_name["host"].num_kept == 0 and kv.num_retained_blocks == 0
    ex = explain(_run(engine, "kept'", kept))
    assert ex.get("device_tokens", 0) == ex.get("host_tokens", 0) == 0
    kv.check_invariants()


def _bound_tiers(cap, host_blocks):
    clock = _Clock()
    kv = KVTiers([HostTier(host_blocks * NBYTES)], BLOCK, NBYTES, io=IOQueue(threaded=False))
    kv.bind(SimpleNamespace(block_manager=BlockManager(8, BLOCK, True, max_retained_blocks=cap,
                                                          clock=clock)))
    return kv, clock


def _entry(h):
    return make_entry(h, 0, (h,) * BLOCK, bytes(NBYTES))


def test_the_tenant_cap_holds_below_the_pool_too():
    kv, clock = _bound_tiers(cap=2, host_blocks=4)
    until = clock.now + 60
    for h in (1, 2, 3):  # a's third retained block un-pins its first
        kv.store(_entry(h), Retention("project:a", until))
    kv.store(_entry(4), Retention("project:b", until))
    host = kv.by_name["host"]
    assert host.num_kept == 3 and kv.num_retained_blocks == 3
    kv.check_invariants()
    kv.store(_entry(5))  # pressure: the un-pinned block goes first, the kept ones stay
    assert not host.contains(1) and all(host.contains(h) for h in (2, 3, 4, 5))
    kv.store(_entry(6))  # the plain one next
    assert not host.contains(5) and all(host.contains(h) for h in (2, 3, 4, 6))
    kv.check_invariants()


def test_a_full_host_of_kept_blocks_still_takes_new_ones():
    """Retention is a priority, never a pin: the oldest kept block makes room."""
    kv, clock = _bound_tiers(cap=8, host_blocks=2)
    for h in (1, 2):
        kv.store(_entry(h), Retention("project:a", clock.now + 60))
    kv.store(_entry(3))
    host = kv.by_name["host"]
    assert not host.contains(1) and host.contains(2) and host.contains(3)
    assert kv.num_retained_blocks == 1  # the dropped block's retention is forgotten
    kv.check_invariants()


def test_the_fake_runner_block_size_is_what_the_tests_assume():
    assert FakeRunner(block_size=BLOCK).block_nbytes == NBYTES
