import dataclasses

import pytest

from servelm.planner.errors import PlanInputError
from servelm.planner.hardware import (
    ACCELERATORS,
    LINKS,
    TIERS,
    get_accelerator,
    get_link,
    get_tier,
    tier_bandwidth,
)

_NUMBERS = ("memory_bytes", "hbm_bandwidth_Bps", "bf16_flops", "fp8_flops", "interconnect",
            "host_link")


@pytest.mark.parametrize("name", list(ACCELERATORS))
def test_every_accelerator_number_has_a_source(name):
    a = ACCELERATORS[name]
    assert set(_NUMBERS) <= set(a.sources)
    assert all("datasheet" in s for s in a.sources.values())
    assert a.interconnect in LINKS and a.host_link in LINKS


def test_all_links_and_tiers_resolve():
    assert all(link.source and link.bandwidth_Bps > 0 for link in LINKS.values())
    assert all(t.storage in LINKS for t in TIERS.values())


def test_h100_ridge_point():
    # H100 SXM datasheet: 989 TFLOPS dense bf16 / 3.35 TB/s = ~295 FLOP per byte, the
    # commonly quoted H100 roofline ridge.
    h = get_accelerator("h100")
    assert h.bf16_flops / h.hbm_bandwidth_Bps == pytest.approx(295, rel=0.01)


def test_a100_has_no_fp8_and_falls_back_to_bf16():
    a = get_accelerator("A100-80GB")
    assert a.fp8_flops is None and a.peak_flops("fp8") == a.bf16_flops


def test_sparsity_is_not_counted():
    # Datasheets headline 2:4-sparse numbers; the catalog must hold the dense half.
    assert get_accelerator("H100-SXM").fp8_flops == pytest.approx(3958e12 / 2, rel=1e-3)


def test_tier_bandwidth_takes_the_slower_side():
    h100 = get_accelerator("H100-SXM")
    bw, limit = tier_bandwidth(get_tier("nvme"), h100, 8)
    assert bw == LINKS["nvme"].bandwidth_Bps and "nvme" in limit
    bw, limit = tier_bandwidth(get_tier("dram"), h100, 1)
    assert bw == LINKS["pcie5"].bandwidth_Bps and "pcie5" in limit


def test_lookups_name_their_flag():
    for fn, flag in ((get_accelerator, "--gpu"), (get_link, "--link"), (get_tier, "--tier")):
        with pytest.raises(PlanInputError) as e:
            fn("nope")
        assert e.value.param == flag


def test_catalog_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_accelerator("B200").memory_bytes = 1
