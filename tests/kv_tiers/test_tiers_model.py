"""KV tiers under a real (tiny, random-weight) model: a history evicted from the device pool
into host memory and disk comes back with the same greedy continuation as recomputing it,
and the reload really ran (cache explain, per-tier hits, fewer prompt tokens computed)."""

import random

from tiny_models import make_tiny_engine

from servelm.protocol import EngineRequest, SamplingParams


def _generate(engine, rid, prompt, max_tokens=8):
    engine.add_request(EngineRequest(rid, list(prompt), SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    out, timings = [], None
    while engine.has_unfinished:
        for d in engine.step():
            if d.request_id == rid:
                out += d.token_ids
                timings = d.timings or timings
        engine.check_invariants()
    return out, timings


def test_reload_from_host_and_disk_gives_the_recomputed_tokens(tiny_hf, tmp_path):
    hf = tiny_hf("llama", seed=3)
    rng = random.Random(0)
    history = [rng.randrange(5, 380) for _ in range(120)]
    others = [[rng.randrange(5, 380) for _ in range(120)] for _ in range(2)]
    # 40 blocks of 4 tokens: each 128-token request evicts the one before it. The host
    # tier holds 40 blocks: the history's last blocks (evicted first) go on to disk.
    kw = {"num_blocks": 40, "block_size": 4, "max_num_batched_tokens": 64}
    plain = make_tiny_engine(hf, **kw)
    tiered = make_tiny_engine(hf, kv_host_memory_gb=40 * 2048 / 1e9, kv_disk_dir=str(tmp_path),
                              kv_disk_gb=0.01, kv_reload_policy="always", **kw)
    kv = tiered.kv_connector
    assert kv is not None and kv.block_nbytes == 2 * 2 * 4 * 2 * 16 * 4  # L K/V bs K D fp32
    want, _ = _generate(plain, "h", history)
    got, _ = _generate(tiered, "h", history)
    assert got == want
    for i, p in enumerate(others):
        _generate(tiered, f"o{i}", p)
    assert kv.by_name["host"].stats.num_stored > 0 and kv.by_name["disk"].stats.num_stored > 0
    computed = tiered.stats.num_computed_prompt_tokens
    again, timings = _generate(tiered, "h2", history)
    ex = timings.cache_explain
    assert ex["decision"] == "reload" and ex["host_tokens"] > 0 and ex["disk_tokens"] > 0, ex
    assert ex["loaded_tokens"] == 116  # 29 full blocks; the last prompt token is computed
    assert tiered.stats.num_computed_prompt_tokens - computed == 120 - 116
    assert again == want
    kv.close()


def test_disk_tier_found_again_after_a_restart_only_by_the_same_weights(tiny_hf, tmp_path,
                                                                        monkeypatch):
    rng = random.Random(1)
    history = [rng.randrange(5, 380) for _ in range(60)]
    others = [[rng.randrange(5, 380) for _ in range(60)] for _ in range(2)]
    kw = {"num_blocks": 20, "block_size": 4, "max_num_batched_tokens": 64,
          "kv_disk_dir": str(tmp_path), "kv_disk_gb": 0.01, "kv_reload_policy": "always"}
    hf = tiny_hf("llama", seed=3)
    first = make_tiny_engine(hf, **kw)
    want, _ = _generate(first, "h", history)
    for i, p in enumerate(others):
        _generate(first, f"o{i}", p)
    first.kv_connector.close()
    stored = first.kv_connector.by_name["disk"].stats.num_blocks
    assert stored >= 14
    # Another model (other weights, same shapes): its own directory, nothing of ours read.
    other = make_tiny_engine(tiny_hf("llama", seed=4), **kw)
    assert other.kv_connector.by_name["disk"].stats.num_blocks == 0
    assert other.kv_connector.by_name["disk"].dir != first.kv_connector.by_name["disk"].dir
    other.kv_connector.close()
    # Another servelm version: likewise.
    from servelm.kv_tiers import build
    monkeypatch.setattr(build, "__version__", "0.0.0-other")
    assert make_tiny_engine(hf, **kw).kv_connector.by_name["disk"].stats.num_blocks == 0
    monkeypatch.undo()
    # The same model again (a restart): the blocks are found and reloaded.
    again = make_tiny_engine(hf, **kw)
    assert again.kv_connector.by_name["disk"].stats.num_blocks == stored
    got, timings = _generate(again, "h", history)
    assert timings.cache_explain["disk_tokens"] == 56 and got == want
    assert again.stats.num_computed_prompt_tokens == 60 - 56
    again.kv_connector.close()


def test_disk_tier_with_lora_is_refused_by_name(tiny_hf, tmp_path):
    import pytest

    with pytest.raises(ValueError, match="kv_disk_dir"):
        make_tiny_engine(tiny_hf("llama", seed=3), num_blocks=20, kv_disk_dir=str(tmp_path),
                         kv_disk_gb=0.01, enable_lora=True)
