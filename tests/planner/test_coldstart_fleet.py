import pytest

from servelm.planner.calibration import Calibration
from servelm.planner.coldstart import plan_coldstart
from servelm.planner.decode import step_time
from servelm.planner.errors import PlanInputError
from servelm.planner.fleet import Workload, plan_fleet
from servelm.planner.hardware import get_tier


def test_coldstart_stages_sum(deploy):
    p = plan_coldstart(deploy("Llama-3.1-70B", tp=4), get_tier("nvme"))
    stages = (p.storage_read_s, p.host_to_gpu_s, p.runtime_init_s, p.warmup_s,
              p.graph_capture_s)
    assert p.total_s == pytest.approx(sum(stages))
    assert p.storage_read_s == pytest.approx(141.1e9 / 7e9, rel=0.01)  # ~20 s from one NVMe
    assert p.total_overlapped_s <= p.total_s


def test_coldstart_uses_calibration(deploy):
    cal = Calibration(runtime_init_s=1, warmup_s=2, graph_capture_s_per_size=0,
                      source="bench.json")
    p = plan_coldstart(deploy(tp=1, calibration=cal), get_tier("dram"))
    assert (p.runtime_init_s, p.warmup_s, p.graph_capture_s) == (1, 2, 0)
    assert p.inputs["calibration"] == "bench.json"


def test_fleet_arithmetic(deploy):
    w = Workload(rps=20, input_len=2000, output_len=300)
    p = plan_fleet(deploy("Llama-3.1-70B", tp=4), w, tp_fixed=True)
    assert p.num_gpus == p.num_replicas * p.tp == p.num_replicas * 4
    assert p.num_replicas * p.replica_rps * w.max_load >= w.rps
    assert (p.num_replicas - 1) * p.replica_rps * w.max_load < w.rps
    d = deploy("Llama-3.1-70B", tp=4)
    assert step_time(d, p.decode_batch, 2150).step_s <= w.tpot_s


def test_fleet_grows_with_rate_and_picks_cheapest_tp(deploy):
    d = deploy("Llama-3.1-70B", tp=4)
    small = plan_fleet(d, Workload(rps=5, input_len=2000, output_len=300))
    big = plan_fleet(d, Workload(rps=50, input_len=2000, output_len=300))
    assert big.num_gpus > small.num_gpus
    assert big.num_gpus == min(r["num_gpus"] for r in big.table if r["meets_ttft"])


def test_fleet_tight_tpot_is_reported(deploy):
    p = plan_fleet(deploy("Llama-3.1-70B", tp=1, weight_dtype="fp8"),
                   Workload(rps=1, input_len=100, output_len=100, tpot_s=0.001), tp_fixed=True)
    assert p.decode_batch == 0 and any("TPOT" in n for n in p.notes)


def test_workload_validation():
    with pytest.raises(PlanInputError, match="--rps"):
        Workload(rps=0, input_len=1, output_len=1)
    with pytest.raises(PlanInputError, match="--max-load"):
        Workload(rps=1, input_len=1, output_len=1, max_load=2)
