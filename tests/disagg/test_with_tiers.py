"""Two KV connectors on one engine: a decode worker that also offloads to host memory.

The decode engine is built with MultiKVConnector([DecodeRole, KVTiers]). Its pool is small,
so the blocks one transfer imported are evicted by the next imports (into the host tier,
saved before the imports overwrite them), and a later request on that prefix reloads them
from host memory. Every token is checked against a plain colocated run, and the checking
runner turns any wrong KV byte into a wrong token.
"""

from __future__ import annotations

from servelm.engine.kv_connector import MultiKVConnector, find_connector
from servelm.kv_tiers.host_tier import HostTier
from servelm.kv_tiers.tiers import KVTiers
from tests.disagg.harness import BLOCK, Pair, colocated, prompt, request


def _pair(decode_blocks: int = 16) -> tuple[Pair, KVTiers]:
    tiers = KVTiers([HostTier(1 << 20)], BLOCK, 8 * BLOCK, "always")
    return Pair(decode_blocks=decode_blocks, decode_extra=lambda: [tiers]), tiers


def _run_plain(pair: Pair, tokens: list[int], max_tokens: int):
    """A request sent to the decode worker itself (no transfer): (tokens, timings)."""
    r = request(tokens, max_tokens)
    pair.outputs[r.request_id] = []
    pair.decode.add_request(r)
    timings = None
    while pair.decode.has_unfinished:
        for d in pair.decode.step():
            pair.outputs[d.request_id].extend(d.token_ids)
            timings = d.timings or timings
        pair.decode.check_invariants()
    return pair.outputs[r.request_id], timings


def test_decode_worker_built_with_both_connectors():
    pair, tiers = _pair()
    assert isinstance(pair.decode.kv_connector, MultiKVConnector)
    assert find_connector(pair.decode.kv_connector, KVTiers) is tiers
    assert find_connector(pair.decode.kv_connector, type(pair.d_role)) is pair.d_role
    report = pair.decode.report()
    assert set(report.kv_tiers) == {"host", "decisions"}
    assert report.kv_transfer["num_started"] == 0


def test_evicted_import_comes_back_from_host_while_transfers_complete():
    pair, tiers = _pair()
    first = prompt(24, seed=1)
    others = [prompt(24, seed=s) for s in (2, 3, 4)]
    for tokens in [first, *others]:
        rid = pair.submit(tokens, max_tokens=6)
        pair.run()
        assert pair.outputs[rid] == colocated([(tokens, 6)])[0]
    d = pair.d_role.stats
    assert d.num_completed == 4 and not d.fallbacks  # every transfer completed
    host = tiers.by_name["host"].stats
    # The later imports evicted the first prompt's blocks from the 16-block pool: saved
    # into host memory before the imports overwrote them, none lost.
    assert host.num_stored > 0 and tiers.num_dropped_saves == 0
    cache = pair.decode.block_manager.prefix_cache
    num_full = (len(first) - 1) // BLOCK
    on_device = len(cache.match(first, None, num_full * BLOCK, record=False).blocks)
    assert on_device < num_full

    # The same prefix on the decode worker again: what left the pool comes from host memory.
    tail = prompt(5, seed=9)
    tokens, timings = _run_plain(pair, first + tail, 6)
    assert tokens == colocated([(first + tail, 6)])[0]
    assert host.num_hits >= num_full - on_device
    assert timings.cache_explain["loaded_tokens"] == host.num_hits * BLOCK
    assert pair.decode.report().kv_tiers["host"]["num_hits"] == host.num_hits

    # And a transfer after the reload still completes, with the tiers in place.
    last = prompt(24, seed=5)
    rid = pair.submit(last, max_tokens=6)
    pair.run()
    assert pair.outputs[rid] == colocated([(last, 6)])[0]
    assert d.num_completed == 5 and not d.fallbacks
    pair.check_clean()
