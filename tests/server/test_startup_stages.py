"""`servelm serve` measures its start-up stage by stage: the log line, /metrics, and the
stages adding up to the ready time (servelm/startup.py)."""

import signal

import httpx
import pytest
from serve_process import ServeProcess


@pytest.mark.slow
def test_serve_reports_stages_that_sum_to_ready(default_model_path, tmp_path):
    """`servelm serve` logs the stages, exports them on /metrics, and they sum to the ready
    time; a second start of the same model reads the index and prepared-weights caches."""
    for attempt in range(2):
        server = ServeProcess()
        try:
            line = next(s for s in server.stderr if "[servelm] serving" in s)
            text = httpx.get(server.url + "/metrics").text
        finally:
            server.proc.send_signal(signal.SIGINT)
            server.proc.wait(60)
        stages = {}
        ready = None
        for row in text.splitlines():
            if row.startswith("servelm_startup_stage_seconds{"):
                stages[row.split('"')[1]] = float(row.split()[-1])
            elif row.startswith("servelm_startup_ready_seconds "):
                ready = float(row.split()[-1])
        for name in ("interpreter", "imports", "config", "tokenizer", "weights_read",
                     "weights_pack", "kv_alloc", "warmup", "frontend_start", "core_spawn",
                     "frontend_ready"):
            assert name in stages, (name, stages)
        assert ready is not None and ready > 0
        assert sum(stages.values()) == pytest.approx(ready, rel=0.05, abs=0.1)
        assert f"ready {ready:.1f} s after start" in line
    # the second start found the caches the first (or an earlier run) left
    assert "prepared-weights cache" in line
    assert "(GGUF index cache)" in line
