"""`servelm bench calibrate --host`: host bandwidths measured for the planner's calibration."""

import argparse
import json

import pytest

from servelm.bench import calibrate
from servelm.planner import cli as plan_cli


def fake_clock(*times):
    """perf_counter stand-in returning `times` in order."""
    it = iter(times)
    return lambda: next(it)


def test_copy_bandwidth_is_bytes_over_the_fastest_repeat():
    # Three repeats of a 4 MB copy taking 2 ms, 1 ms and 4 ms: the fastest, 1 ms, gives
    # 4e6 / 1e-3 = 4 GB/s (the slower ones were other processes on a shared machine).
    t = calibrate.measure_memory_copy(4_000_000, repeats=3,
                                      clock=fake_clock(0.0, 0.002, 1.0, 1.001, 2.0, 2.004))
    assert (t.num_bytes, t.seconds) == (4_000_000, pytest.approx(0.001))
    assert t.bandwidth_Bps == pytest.approx(4e9)


def test_disk_read_reads_the_whole_sample_and_cleans_up(tmp_path):
    # 3 MB rounds down to whole 4 KiB blocks: 3,000,000 - 3,000,000 % 4,096 = 2,998,272 B.
    t = calibrate.measure_disk_read(tmp_path, 3_000_000, repeats=1,
                                    clock=fake_clock(0.0, 0.5))
    assert t.num_bytes == 2_998_272
    assert t.bandwidth_Bps == pytest.approx(2_998_272 / 0.5)
    assert list(tmp_path.iterdir()) == []


def test_clock_that_does_not_advance_is_an_error():
    with pytest.raises(RuntimeError, match="sample-mb"):
        calibrate.measure_memory_copy(1000, repeats=1, clock=fake_clock(1.0, 1.0))


def test_merge_keeps_other_keys(tmp_path):
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"decode_mfu": 0.7, "disk_bandwidth_Bps": 1.0}))
    data = calibrate.merge_calibration(f, {"disk_bandwidth_Bps": 2e9}, "here")
    assert data == {"decode_mfu": 0.7, "disk_bandwidth_Bps": 2e9, "source": "here"}


def _args(tmp_path, **kw):
    base = {"host": True, "disk_dir": str(tmp_path), "sample_mb": 2.0, "no_progress": True,
            "out": str(tmp_path / "cal.json")}
    return argparse.Namespace(**{**base, **kw})


def test_host_calibration_feeds_the_planner(tmp_path, capsys, monkeypatch):
    # No GPU here, so no host-link figure: the planner keeps the catalog's PCIe for it.
    monkeypatch.setattr(calibrate, "measure_host_to_gpu", lambda n: None)
    assert calibrate.cmd_calibrate_host(_args(tmp_path)) == 0
    written = json.loads((tmp_path / "cal.json").read_text())
    assert set(written) == {"host_memory_bandwidth_Bps", "disk_bandwidth_Bps", "source"}
    assert all(written[k] > 0 for k in ("host_memory_bandwidth_Bps", "disk_bandwidth_Bps"))
    capsys.readouterr()
    assert plan_cli.main(["plan", "offload", "--tier", "nvme", "--calibration",
                          str(tmp_path / "cal.json"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # Llama-3.1-8B on one GPU: min(measured disk, 63 GB/s PCIe Gen5).
    assert plan["tier_bandwidth_Bps"] == pytest.approx(min(written["disk_bandwidth_Bps"], 63e9))


@pytest.mark.parametrize("kw,flag", [({"sample_mb": 0}, "--sample-mb"),
                                     ({"disk_dir": "/no/such/dir"}, "--disk-dir")])
def test_bad_host_flags_name_the_flag(tmp_path, kw, flag):
    with pytest.raises(SystemExit) as e:
        calibrate.cmd_calibrate_host(_args(tmp_path, **kw))
    assert flag in str(e.value)


def test_parser_routes_host_to_the_host_measurement():
    parser = argparse.ArgumentParser()
    calibrate.add_parser(parser.add_subparsers())
    args = parser.parse_args(["calibrate", "--host", "--sample-mb", "8"])
    assert args.host and args.sample_mb == 8.0 and args.func is calibrate._cmd


def test_host_link_is_measured_only_with_a_gpu():
    torch = pytest.importorskip("torch")
    t = calibrate.measure_host_to_gpu(64_000_000, repeats=2)
    if not torch.cuda.is_available():
        assert t is None  # nothing is filled in that was not measured
    else:  # any PCIe Gen3 x16 link or better moves more than 1 GB/s
        assert t.num_bytes == 64_000_000 and t.bandwidth_Bps > 1e9
