"""Tier and link bandwidths as inputs: --calibration keys and flags replace catalog figures."""

import json

import pytest

from servelm.planner import cli
from servelm.planner.calibration import Calibration, load_calibration
from servelm.planner.coldstart import plan_coldstart
from servelm.planner.disagg import plan_disagg
from servelm.planner.errors import PlanInputError
from servelm.planner.fleet import Workload, plan_fleet
from servelm.planner.hardware import get_link, get_tier
from servelm.planner.offload import plan_offload


def run_json(capsys, *argv):
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_measured_disk_sets_the_nvme_reload(deploy):
    # 8,192 tokens x 327,680 B (Llama-3.1-70B) = 2,684,354,560 B over a measured 2 GB/s disk
    # (slower than 8 x PCIe Gen5) = 1.342 s, instead of the catalog NVMe's 7 GB/s -> 0.383 s.
    d = deploy("Llama-3.1-70B", tp=8, calibration=Calibration(disk_bandwidth_Bps=2e9))
    p = plan_offload(d, 8192, get_tier("nvme"))
    assert p.tier_bandwidth_Bps == 2e9
    assert p.reload_time_s == pytest.approx(2_684_354_560 / 2e9)
    rows = {r["tier"]: r for r in p.table}
    assert rows["nvme"]["bandwidth_GBps"] == 2.0
    assert rows["dram"]["bandwidth_GBps"] == 307.0  # 8 x pcie5 = 504 GB/s > ddr5 307 GB/s


def test_slow_host_link_limits_the_dram_tier(deploy):
    # One GPU behind a 1 GB/s host link: min(ddr5 307 GB/s, 1 x 1 GB/s) = 1 GB/s.
    d = deploy(tp=1, calibration=Calibration(host_link_bandwidth_Bps=1e9))
    p = plan_offload(d, 1000, get_tier("dram"))
    assert p.tier_bandwidth_Bps == 1e9
    assert "host link (set)" in p.steps[1].substituted
    # Llama-3.1-8B: 1,000 x 131,072 B = 131 MB over 1 GB/s = 0.131 s
    assert p.reload_time_s == pytest.approx(1000 * 131_072 / 1e9)


def test_coldstart_reads_weights_at_the_set_bandwidths(deploy):
    # Llama-3.1-8B bf16: 8,030,261,248 params x 2 B = 16.06 GB; over a 2 GB/s disk 8.03 s,
    # then over one 10 GB/s host link 1.606 s.
    cal = Calibration(disk_bandwidth_Bps=2e9, host_link_bandwidth_Bps=10e9)
    p = plan_coldstart(deploy(tp=1, calibration=cal), get_tier("nvme"))
    assert p.weight_bytes == 8_030_261_248 * 2
    assert p.storage_read_s == pytest.approx(16_060_522_496 / 2e9)
    assert p.host_to_gpu_s == pytest.approx(16_060_522_496 / 10e9)
    assert p.inputs["disk_bandwidth_Bps"] == 2e9
    by_tier = {r["tier"]: r for r in p.table}
    assert by_tier["nvme"]["storage_read_s"] == pytest.approx(8.03, abs=0.01)
    assert by_tier["dram"]["host_to_gpu_s"] == pytest.approx(1.61, abs=0.01)


def test_disagg_link_bandwidth_can_be_set(deploy):
    # Llama-2-7B, 4,096 tokens x 524,288 B = 2,147,483,648 B over 25 GB/s = 0.0859 s.
    d = deploy("Llama-2-7B", tp=1, calibration=Calibration(kv_link_bandwidth_Bps=25e9))
    p = plan_disagg(d, 4096, get_link("nic-100g"))
    assert p.link_bandwidth_Bps == 25e9
    assert p.transfer_time_s == pytest.approx(2_147_483_648 / 25e9)


def test_flag_overrides_the_calibration_file(capsys, tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"disk_bandwidth_Bps": 1e9, "prefill_mfu": 0.4}))
    from_file = run_json(capsys, "offload", "--tier", "nvme", "--calibration", str(cal))
    assert from_file["tier_bandwidth_Bps"] == 1e9 and from_file["inputs"]["mfu"] == 0.4
    flagged = run_json(capsys, "offload", "--tier", "nvme", "--calibration", str(cal),
                       "--disk-bw", "3")
    assert flagged["tier_bandwidth_Bps"] == 3e9
    assert flagged["inputs"]["disk_bandwidth_Bps"] == 3e9
    link = run_json(capsys, "disagg", "--link", "nic-100g", "--link-bw", "40")
    assert link["inputs"]["tp"] == 1 and link["link_bandwidth_Bps"] == 40e9  # not 12.5e9


@pytest.mark.parametrize("argv,flag", [
    (["offload", "--disk-bw", "0"], "--disk-bw"),
    (["coldstart", "--pcie-bw", "-2"], "--pcie-bw"),
    (["disagg", "--link-bw", "fast"], "--link-bw"),
    (["fleet", "--mfu", "0.5"], "--mfu"),  # one MFU for two phases is gone from fleet
])
def test_bad_bandwidth_flags_exit_2(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", *argv])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_bad_bandwidth_in_the_file_names_the_key(tmp_path):
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"host_memory_bandwidth_Bps": -5}))
    with pytest.raises(PlanInputError) as e:
        load_calibration(f)
    assert e.value.param == "calibration.host_memory_bandwidth_Bps"


def test_fleet_has_one_mfu_per_phase(deploy):
    # Prefill of 2,000 tokens of Llama-3.1-8B: 2,000 x 15,009,841,152 FLOP of matmuls +
    # 524,288 FLOP per pair x 2,000 x 2,001 / 2 pairs = 3.1069e13 FLOP; at prefill MFU 0.25
    # on 989 TFLOP/s that is 0.1257 s. The decode MFU only moves compute-bound decode steps.
    w = Workload(rps=1, input_len=2000, output_len=300)
    d = deploy(tp=1, calibration=Calibration(prefill_mfu=0.25, decode_mfu=0.5))
    p = plan_fleet(d, w, tp_fixed=True)
    flops = 2000 * 15_009_841_152 + 524_288 * 2000 * 2001 / 2
    prefill = next(s for s in p.steps if s.name == "prefill_time_s")
    assert prefill.value == pytest.approx(flops / (989e12 * 0.25))
    assert (p.inputs["prefill_mfu"], p.inputs["decode_mfu"]) == (0.25, 0.5)


def test_fleet_flags_reach_their_phase(capsys):
    base = run_json(capsys, "fleet", "--tp", "1")
    slow = run_json(capsys, "fleet", "--tp", "1", "--prefill-mfu", "0.25")
    def step(result, name):
        return next(s["value"] for s in result["steps"] if s["name"] == name)

    pre, dec = (lambda r: step(r, "prefill_time_s")), (lambda r: step(r, "decode_step_s"))
    assert pre(slow) == pytest.approx(2 * pre(base))
    assert dec(slow) == pytest.approx(dec(base))
    assert (slow["inputs"]["prefill_mfu"], slow["inputs"]["decode_mfu"]) == (0.25, 1.0)
