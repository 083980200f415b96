"""KV tiers under the engine with the fake runner: blocks move down on eviction, come back
checked, survive a restart, stay within their limits and inside their tenant's salt."""

import random

import pytest
from tiers_helpers import FINGERPRINT, explain, run, tiered_engine

from servelm.kv_tiers.disk_tier import bytes_on_disk


def _prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(10, 900) for _ in range(n)]


def _flush(engine, seeds, n=40):
    """Other prompts through the pool: every cached block of earlier ones is evicted."""
    run(engine, [_prompt(s, n) for s in seeds], prefix=f"flush{seeds[0]}-")


def test_evicted_blocks_move_to_host_and_reload_checked():
    engine, kv, runner = tiered_engine(num_blocks=16, host_bytes=1 << 20)
    history = _prompt(1, 40)
    first, _ = run(engine, [history], prefix="a")
    _flush(engine, [2, 3])
    assert kv.by_name["host"].stats.num_stored >= 9, kv.stats()
    computed = runner.num_tokens_computed
    again, fin = run(engine, [history], prefix="a")  # the same turn again: a returning user
    ex = explain(fin["a0"])
    assert ex["decision"] == "reload" and ex["device_tokens"] == 0
    assert ex["host_tokens"] == ex["loaded_tokens"] == 36  # 9 full blocks, one token left
    assert again == first
    # only the last prompt token and the decodes were computed: the rest was reloaded
    assert runner.num_tokens_computed - computed == 4 + 3
    assert kv.by_name["host"].stats.num_hits == 9
    assert fin["a0"].num_cached_tokens == 36


def test_host_evictions_move_to_disk_and_disk_reads_wait_off_the_step(tmp_path):
    nbytes = 8 * 4  # the fake runner's block
    engine, kv, _runner = tiered_engine(num_blocks=16, host_bytes=4 * nbytes,
                                       disk_dir=tmp_path, disk_bytes=1 << 20)
    history = _prompt(1, 40)
    first, _ = run(engine, [history], prefix="a")
    _flush(engine, [2, 3])
    disk = kv.by_name["disk"]
    assert disk.stats.num_stored > 0 and kv.by_name["host"].stats.num_evicted > 0
    kv.io.drain()
    kv.poll()
    assert len(list(disk.dir.glob("*.kvb"))) == disk.stats.num_blocks
    # A request whose prefix is on disk waits (its reads are queued) while another runs.
    from servelm.protocol import EngineRequest, SamplingParams
    engine.add_request(EngineRequest("busy", _prompt(9, 6), SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True)))
    engine.step()
    engine.add_request(EngineRequest("back", history, SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True)))
    engine.step()  # "back" is planned: disk reads queued, it is skipped this step
    assert kv.is_busy and [s.request_id for s in engine.scheduler.running] == ["busy"]
    out = {"back": [], "busy": []}
    fin = {}
    while engine.has_unfinished:
        for d in engine.step():
            out[d.request_id] += d.token_ids
            if d.timings:
                fin[d.request_id] = d.timings
        engine.check_invariants()
    ex = explain(fin["back"])
    assert ex["decision"] == "reload" and ex["disk_tokens"] > 0, ex
    assert ex["loaded_tokens"] == 36
    assert out["back"] == first["a0"]
    assert disk.stats.num_hits > 0


def test_corrupt_or_missing_file_falls_back_to_recompute(tmp_path):
    engine, kv, _runner = tiered_engine(num_blocks=16, disk_dir=tmp_path, disk_bytes=1 << 20)
    history = _prompt(1, 40)
    first, _ = run(engine, [history], prefix="a")
    _flush(engine, [2, 3])
    kv.io.drain()
    kv.poll()
    disk = kv.by_name["disk"]
    from servelm.engine.prefix_cache import block_hashes
    hashes = block_hashes(history, 4)
    raw = bytearray(disk.path(hashes[3]).read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit in block 3's data
    disk.path(hashes[3]).write_bytes(bytes(raw))
    disk.path(hashes[6]).unlink()  # and block 6 gone
    again, fin = run(engine, [history], prefix="a")
    ex = explain(fin["a0"])
    assert again == first  # the checking runner also saw only right KV
    assert ex["loaded_tokens"] == 12, ex  # blocks 0-2; 3 failed: it and the rest recomputed
    assert disk.stats.num_failed >= 1 and not disk.contains(hashes[3])


def test_disk_tier_survives_a_restart_and_ignores_another_model(tmp_path):
    history = _prompt(1, 40)
    engine, kv, _ = tiered_engine(num_blocks=16, disk_dir=tmp_path, disk_bytes=1 << 20)
    first, _ = run(engine, [history], prefix="a")
    _flush(engine, [2, 3])
    kv.close()
    stored = kv.by_name["disk"].stats.num_blocks
    assert stored >= 9
    # Another model (fingerprint) in the same directory: reads nothing, counts the files.
    other, okv, _ = tiered_engine(num_blocks=16, disk_dir=tmp_path, disk_bytes=1 << 20,
                                  fingerprint={**FINGERPRINT, "model": "other"})
    assert okv.by_name["disk"].stats.num_blocks == 0
    assert okv.by_name["disk"].stats.used_bytes == bytes_on_disk(tmp_path)
    _, fin = run(other, [history], prefix="a")
    assert explain(fin["a0"])["decision"] == "none"
    okv.close()
    # The same model again: the blocks of the first run are found and reloaded.
    engine2, kv2, runner2 = tiered_engine(num_blocks=16, disk_dir=tmp_path,
                                          disk_bytes=1 << 20)
    assert kv2.by_name["disk"].stats.num_blocks == stored
    again, fin = run(engine2, [history], prefix="a")
    assert explain(fin["a0"])["disk_tokens"] == 36 and again == first
    assert runner2.num_tokens_computed == 4 + 3


def test_disk_limit_holds_on_disk(tmp_path):
    limit = 6 * (48 + 8 * 4 + 32)  # six block files of the fake runner's size
    engine, kv, _ = tiered_engine(num_blocks=16, disk_dir=tmp_path, disk_bytes=limit)
    for i in range(6):
        run(engine, [_prompt(10 + i, 40)], prefix=f"x{i}-")
        kv.io.drain()
        kv.poll()
        assert bytes_on_disk(tmp_path) <= limit
    assert kv.by_name["disk"].stats.num_evicted > 0
    # A smaller limit at the next start trims the directory at once.
    kv.close()
    _, kv2, _ = tiered_engine(num_blocks=16, disk_dir=tmp_path, disk_bytes=limit // 2)
    kv2.io.drain()
    assert bytes_on_disk(tmp_path) <= limit // 2


def test_tenant_salts_isolate_every_tier(tmp_path):
    engine, _kv, _runner = tiered_engine(num_blocks=16, host_bytes=6 * 32, disk_dir=tmp_path,
                                       disk_bytes=1 << 20)
    history = _prompt(1, 40)
    run(engine, [history], salt="tenant-a", prefix="a")
    _flush(engine, [2, 3])
    _, fin = run(engine, [history], salt="tenant-b", prefix="b")
    ex = explain(fin["b0"])
    assert ex["host_tokens"] == ex["disk_tokens"] == ex["loaded_tokens"] == 0
    _, fin = run(engine, [history], salt="tenant-a", prefix="a2-")
    assert explain(fin["a2-0"])["loaded_tokens"] == 36


def test_cost_policy_recomputes_when_reload_is_slower():
    from servelm.kv_tiers.reload_policy import PrefillEstimate
    from servelm.engine.step_cost_model import StepCostModel

    engine, kv, _runner = tiered_engine(num_blocks=16, host_bytes=1 << 20, policy="cost")
    history = _prompt(1, 40)
    run(engine, [history], prefix="a")
    _flush(engine, [2, 3])
    host = kv.by_name["host"]
    host._meter.bandwidth_Bps = 1e3  # 288 bytes at 1 kB/s: 0.29 s
    kv.estimate = PrefillEstimate(StepCostModel("test", per_prefill_token_s=1e-3))  # 36 ms
    _, fin = run(engine, [history], prefix="a")
    ex = explain(fin["a0"])
    assert ex["decision"] == "recompute" and ex["loaded_tokens"] == 0
    assert ex["reload_s"] == pytest.approx(0.288) and ex["recompute_s"] == pytest.approx(0.036)
    assert explain(fin["a0"])["device_tokens"] == 0
    _flush(engine, [4, 5])  # the recomputed blocks are on the device again: push them out
    host._meter.bandwidth_Bps = 1e6  # 0.3 ms: reload
    _, fin = run(engine, [history], prefix="b")
    assert explain(fin["b0"])["decision"] == "reload"
    assert kv.stats()["decisions"] == {"reload": 1, "recompute": 1, "dropped_saves": 0}


def test_blocks_evicted_for_a_kv_import_are_saved_before_the_import_writes_them():
    """A KV import (disaggregation) reserves blocks, which may evict cached ones, and writes
    them in a KV-only step: the evicted contents are read in that step, before the write."""
    from servelm.core.contract import KVBlock
    from servelm.engine.prefix_cache import block_hashes

    engine, kv, runner = tiered_engine(num_blocks=16, host_bytes=1 << 20)
    history = _prompt(1, 60)
    run(engine, [history], prefix="a")  # 15 cached blocks, all cached-only now
    blocks = engine.block_manager.reserve(8)
    assert len(kv._queued) >= 7
    engine.execute_kv([], [KVBlock(b, bytes(runner.block_nbytes)) for b in blocks])
    host = kv.by_name["host"]
    saved = [h for h in block_hashes(history, 4) if host.contains(h)]
    assert len(saved) >= 7
    for h in saved:  # the bytes are the history's tokens, not the import's zeros
        assert host.peek(h).data != bytes(runner.block_nbytes)
    engine.block_manager.unpin(blocks)
    _, fin = run(engine, [history], prefix="b")
    assert explain(fin["b0"])["host_tokens"] > 0
