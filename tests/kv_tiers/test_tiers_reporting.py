"""What the tiers report: the per-request cache explain reaches the timing breakdown (the
x-servelm-timing header and the request log) across the engine-core wire, and the per-tier
counters reach Prometheus."""

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from tiers_helpers import run, tiered_engine

from servelm.core.codec import CoreMessage, Decoder, Outputs, encode
from servelm.kv_tiers.metrics import KVTierMetrics
from servelm.server.metrics import timing_breakdown


def _returning_turn(tmp_path):
    engine, kv, _ = tiered_engine(num_blocks=16, host_bytes=12 * 32, disk_dir=tmp_path,
                                  disk_bytes=1 << 20)
    rng = random.Random(1)
    history = [rng.randrange(10, 900) for _ in range(40)]
    run(engine, [history], prefix="a")
    run(engine, [[rng.randrange(10, 900) for _ in range(40)] for _ in range(2)], prefix="f")
    _, fin = run(engine, [history], prefix="b")
    return engine, kv, fin["b0"]


def test_cache_explain_crosses_the_wire_into_the_timing_breakdown(tmp_path):
    engine, _, timings = _returning_turn(tmp_path)
    report = engine.report(0.01)
    wire = Decoder(CoreMessage).decode(encode(Outputs([], report)))
    assert wire.report.kv_tiers == report.kv_tiers
    assert report.kv_tiers["host"]["num_hits"] > 0 and report.kv_tiers["disk"]["num_hits"] > 0
    from servelm.protocol import TokenDelta
    delta = Decoder(CoreMessage).decode(encode(Outputs([TokenDelta("b0", 0, "", [5],
                                                                   timings=timings)])))
    out = timing_breakdown(delta.deltas[0].timings, 40, 4)
    ex = out["cache_explain"]
    assert ex["decision"] == "reload" and ex["host_tokens"] + ex["disk_tokens"] == 36
    assert ex["loaded_tokens"] == 36 and ex["reload_bytes"] == 9 * 32
    assert ex["host_bandwidth_Bps"] >= 0 and "recompute_s" in ex
    assert out["num_cached_tokens"] == 36


def test_tier_counters_reach_prometheus(tmp_path):
    engine, kv, _ = _returning_turn(tmp_path)
    reg = CollectorRegistry()
    metrics = KVTierMetrics(reg)
    metrics.observe_report(engine.report().kv_tiers)
    metrics.observe_report(engine.report().kv_tiers)  # the same totals again: no double count
    text = generate_latest(reg).decode()
    host, disk = kv.by_name["host"].stats, kv.by_name["disk"].stats
    assert f'servelm_kv_tier_hit_blocks_total{{tier="host"}} {float(host.num_hits)}' in text
    assert f'servelm_kv_tier_stored_blocks_total{{tier="disk"}} {float(disk.num_stored)}' in text
    assert f'servelm_kv_tier_used_bytes{{tier="host"}} {float(host.used_bytes)}' in text
    assert 'servelm_kv_tier_decisions_total{decision="reload"} 1.0' in text
    assert host.num_hits + disk.num_hits == 9


@pytest.mark.parametrize("kwargs, param", [
    ({"kv_disk_dir": "/tmp/x"}, "kv_disk_gb"),
    ({"kv_disk_gb": 1.0}, "kv_disk_dir"),
    ({"kv_host_memory_gb": -1.0}, "kv_host_memory_gb"),
    ({"kv_host_memory_gb": 1.0, "kv_reload_policy": "sometimes"}, "kv_reload_policy"),
])
def test_bad_tier_flags_are_refused_by_name(kwargs, param):
    from servelm.config import EngineArgs

    with pytest.raises(ValueError, match=param):
        EngineArgs(model="m", **kwargs)


def test_tiers_need_the_prefix_cache():
    from fake_runner import make_engine

    from servelm.kv_tiers.host_tier import HostTier
    from servelm.kv_tiers.tiers import KVTiers

    with pytest.raises(ValueError, match="prefix cache"):
        make_engine(prefix_caching=False, kv_connector=KVTiers([HostTier(1024)], 4, 32))
