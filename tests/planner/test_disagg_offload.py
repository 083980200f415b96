import pytest

from servelm.planner.disagg import plan_disagg
from servelm.planner.hardware import LINKS, get_link, get_tier
from servelm.planner.offload import crossover_tokens, plan_offload, recompute_time


def test_disagg_bytes_and_time(deploy):
    d = deploy("Llama-3.1-70B", tp=8)
    p = plan_disagg(d, 8192, get_link("nic-400g"))
    assert p.kv_transfer_bytes == 8192 * 327_680  # 2.68 GB for one 8k prompt
    assert p.transfer_time_s == pytest.approx(p.kv_transfer_bytes / (8 * 50e9))


def test_break_even_bandwidth_equalises_transfer_and_prefill(deploy):
    d = deploy("Llama-3.1-8B", tp=1)
    p = plan_disagg(d, 4096, get_link("pcie4"))
    assert p.kv_transfer_bytes / p.break_even_bandwidth_Bps == pytest.approx(p.prefill_time_s)
    fast = plan_disagg(d, 4096, get_link("nvlink4"))
    slow = plan_disagg(d, 4096, get_link("nic-100g"))
    assert fast.transfer_over_prefill < slow.transfer_over_prefill


def test_mla_ships_one_latent_copy(deploy):
    p = plan_disagg(deploy("DeepSeek-V3", "H200", tp=8, weight_dtype="fp8"), 1000,
                    get_link("nic-400g"))
    assert p.link_bandwidth_Bps == LINKS["nic-400g"].bandwidth_Bps


def test_offload_crossover_bandwidth(deploy):
    d = deploy("Llama-3.1-70B", tp=8)
    p = plan_offload(d, 8192, get_tier("nvme"))
    assert p.reload_time_s == pytest.approx(8192 * 327_680 / 7e9)
    assert 8192 * 327_680 / p.crossover_bandwidth_Bps == pytest.approx(p.recompute_time_s)
    assert p.reload_wins == (p.tier_bandwidth_Bps > p.crossover_bandwidth_Bps)


def test_crossover_tokens_separates_winners(deploy):
    # A tiny model recomputes fast, so slow NVMe only wins for long prefixes (attention).
    d = deploy("SmolLM2-135M", tp=1)
    bw = 7e9
    n = crossover_tokens(d, bw, 0.5)
    assert n > 1
    reload = lambda t: t * d.kv_bytes_per_token / bw  # noqa: E731
    assert reload(n - 1) >= recompute_time(d, n - 1, 0.5)
    assert reload(n + 1) < recompute_time(d, n + 1, 0.5)


def test_dram_always_beats_recompute_for_big_models(deploy):
    p = plan_offload(deploy("Llama-3.1-70B", tp=1), 1024, get_tier("dram"))
    assert p.crossover_tokens == 0 and p.reload_wins
    assert [r["tier"] for r in p.table] == ["dram", "nvme", "network"]
