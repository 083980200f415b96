"""Start-up stages (servelm/startup.py): the timer, the process start time, the lazily zeroed
KV pool (a real server's stages: tests/server/test_startup_stages.py)."""

import subprocess
import sys
import time
import types

import pytest
import torch

from servelm import startup


def test_timer_stages_sum_and_refuse_unknown_names(monkeypatch):
    now = [100.0]  # a fake clock: the stage lasts what the test says, on any machine
    monkeypatch.setattr(startup, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    t = startup.StartupTimer()
    t.add("config", 0.25)
    t.add("config", 0.25)
    with t.stage("kv_alloc", note="lazy"):
        now[0] += 0.0125
    t.add("warmup", -1.0)  # clock noise never makes a stage negative
    assert t.stages["config"] == 0.5 and t.stages["warmup"] == 0.0
    assert t.stages["kv_alloc"] == pytest.approx(0.0125)
    assert t.total == pytest.approx(0.5125)
    assert t.summary().startswith("config 0.50, kv_alloc 0.01") and "(lazy)" in t.summary()
    with pytest.raises(ValueError, match="unknown start-up stage 'weights'"):
        t.add("weights", 1.0)


def test_process_start_time_is_this_process_start():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from servelm import startup; "
                          "print(startup.process_start_time(), time.time())"],
                         capture_output=True, text=True, check=True).stdout.split()
    started, now = float(out[0]), float(out[1])
    assert before - 0.05 <= started <= now  # clock ticks are 10 ms


def test_kv_pool_is_zero_writable_and_lazily_backed():
    from servelm.attention.kv_cache import _zeros

    before = _resident_bytes()
    pool = _zeros((8, 1 << 20, 4, 16), torch.float32, "cpu")  # 2 GiB, untouched
    # not written at allocation (torch.zeros would make all of it resident)
    assert _resident_bytes() - before < pool.nbytes // 8
    assert pool.is_contiguous() and pool.dtype == torch.float32
    layer = pool[5]
    del pool
    layer[123, 2] = 7.0
    assert float(layer.sum()) == 7.0 * 16 and float(layer[0].abs().sum()) == 0.0
    fp8 = _zeros((2, 8), torch.float8_e4m3fn, "cpu")
    assert fp8.float().abs().sum() == 0


def _resident_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_kv_pool_is_a_private_map():
    """Private anonymous memory, not shared (/dev/zero): cheaper to fault in as blocks fill."""
    from servelm.attention.kv_cache import _zeros

    pool = _zeros((4 << 20,), torch.uint8, "cpu")
    addr = pool.data_ptr()
    for line in open("/proc/self/maps"):
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            assert perms == "rw-p", line
            break
    else:
        raise AssertionError("the pool's mapping is not in /proc/self/maps")


def test_kernels_stage_says_whether_it_compiled(tmp_path, monkeypatch):
    from servelm import cpu_kernels

    cpu_kernels.load()
    assert cpu_kernels.is_built()
    monkeypatch.setenv("SERVELM_HOME", str(tmp_path))  # a machine that never built them
    assert not cpu_kernels.is_built()
