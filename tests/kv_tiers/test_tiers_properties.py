"""Property test: any workload over a small pool with tiers below it keeps the block
manager's invariant after every step, feeds every chunk only right KV (the checking
runner), keeps every tier within its limit, and produces the tokens an engine without
tiers produces."""

import shutil
import tempfile

from fake_runner import make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers_helpers import CheckingRunner, tiered_engine

from servelm.kv_tiers.disk_tier import bytes_on_disk
from servelm.protocol import EngineRequest, SamplingParams

_BLOCK = 4
_ENTRY = 8 * _BLOCK  # the fake runner's block bytes
_FILE = 48 + 8 * _BLOCK + _ENTRY  # one block file on disk

_SEEN = {"reloads": 0, "examples": 0}

turns = st.lists(st.tuples(st.integers(0, 3),  # which conversation (shared prefix)
                           st.integers(1, 30),  # new tokens this turn
                           st.sampled_from([None, "t1", "t2"]),  # tenant salt
                           st.integers(1, 6)),  # max_tokens
                 min_size=2, max_size=10)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=turns, num_blocks=st.integers(12, 24), host_blocks=st.integers(0, 12),
       disk_blocks=st.sampled_from([0, 3, 40]), budget=st.sampled_from([8, 16, 64]),
       batch=st.integers(1, 3))
def test_any_workload_keeps_invariants_and_tokens(turns, num_blocks, host_blocks, disk_blocks,
                                                   budget, batch):
    if host_blocks == 0 and disk_blocks == 0:
        host_blocks = 1
    tmp = tempfile.mkdtemp() if disk_blocks else None
    try:
        engine, kv, _runner = tiered_engine(
            num_blocks=num_blocks, block_size=_BLOCK, host_bytes=host_blocks * _ENTRY,
            disk_dir=tmp, disk_bytes=disk_blocks * _FILE, budget=budget)
        plain = make_engine(num_blocks=num_blocks, block_size=_BLOCK,
                            max_num_batched_tokens=budget, prefix_caching=True,
                            runner=CheckingRunner(_BLOCK))
        histories = {c: [100 + c] * 3 for c in range(4)}
        for i in range(0, len(turns), batch):
            group = turns[i:i + batch]
            for conv, n, salt, max_tokens in group:
                histories[conv] = histories[conv] + [(conv * 37 + n + k) % 800 + 10
                                                      for k in range(n)]
            limit = num_blocks * _BLOCK - 8
            reqs = [(f"{i}-{j}", histories[conv][-limit:], max_tokens, salt)
                    for j, (conv, _, salt, max_tokens) in enumerate(group)]
            assert _run_together(engine, reqs) == _run_together(plain, reqs)
            kv.check_invariants()
            if tmp:
                kv.io.drain()
                kv.poll()
                assert bytes_on_disk(tmp) <= disk_blocks * _FILE
        assert engine.block_manager.num_free_blocks == num_blocks
        _SEEN["reloads"] += kv.num_reload
        _SEEN["examples"] += 1
    finally:
        if tmp:
            shutil.rmtree(tmp)


def _run_together(engine, reqs):
    """All requests at once (they share steps and compete for blocks); invariants checked
    after every step."""
    out = {}
    for rid, prompt, max_tokens, salt in reqs:
        engine.add_request(EngineRequest(rid, list(prompt), SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, cache_salt=salt)))
        out[rid] = []
    while engine.has_unfinished:
        for d in engine.step():
            out[d.request_id] += d.token_ids
        engine.check_invariants()
    return out
