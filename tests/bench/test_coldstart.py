"""`servelm bench coldstart` against real `servelm serve` processes: a cold-cache run, then a
warm one that reads the GGUF index and the prepared weights the cold one wrote."""

import argparse
import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_cold_then_warm_start(default_model_path, tmp_path, monkeypatch):
    from servelm.bench.coldstart import cmd_coldstart

    # A home of its own: the caches start empty, and the C++ kernels stay out of it (a
    # first build would add a minute; the torch path starts the same way otherwise).
    monkeypatch.setenv("SERVELM_HOME", str(tmp_path / "home"))
    out = tmp_path / "coldstart.json"
    args = argparse.Namespace(model=str(default_model_path), runs=1, cold_first=True,
                              serve_arg=["--cpu-kernels=torch", "--kv-cache-memory=64MiB"],
                              timeout=300.0, out=str(out))
    assert cmd_coldstart(args) == 0
    rec = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert rec["kind"] == "coldstart" and rec["machine"] and "command" in rec
    cold, warm = rec["runs"]
    assert cold["cold"] and not warm["cold"]
    for run in (cold, warm):
        assert sum(run["stages_s"].values()) == pytest.approx(run["ready_s"], rel=0.05,
                                                              abs=0.1)
        assert run["health_s"] >= run["ready_s"] - 0.05  # the client sees it after
        assert run["first_token_s"] > run["health_s"]
    # the cold run parsed the GGUF and wrote the prepared weights; the warm run read both
    assert "weights_cache" in cold["stages_s"] and "weights_cache" not in warm["stages_s"]
    assert any("prepared-weights cache" in line for line in warm["log"])
    assert not any("prepared-weights cache" in line for line in cold["log"])
    assert warm["stages_s"]["config"] < cold["stages_s"]["config"]
    assert warm["stages_s"]["weights_read"] < cold["stages_s"]["weights_read"]
    assert rec["warm_median"]["ready_s"] == warm["ready_s"]


def test_a_server_that_dies_while_starting_is_told_with_its_last_lines(tmp_path, monkeypatch):
    """The run's server is started by the launcher: a start that fails names the process,
    how it ended and what it said last."""
    from servelm.bench.coldstart import one_run
    from servelm.launch import LaunchError

    monkeypatch.setenv("SERVELM_HOME", str(tmp_path / "home"))
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(LaunchError, match="servelm serve .* exited with code 2 while starting"
                       ) as info:
        one_run(missing, ["--engine-core=thread", f"--state-store=sqlite:///{tmp_path}/s.db"],
                300.0, cold=False)
    assert f"cannot load model '{missing}'" in str(info.value)


def test_a_cold_run_clears_the_prepared_weights_of_every_dtype(default_model_path, tmp_path,
                                                               monkeypatch):
    """--dtype auto runs bfloat16 on some CPUs and float32 on others: a cold run must not find
    the prepared weights of either."""
    import torch

    from servelm.bench.coldstart import clear_model_caches
    from servelm.loader import load_model_config, prepared, resolve_model
    from servelm.models import get_model_class

    monkeypatch.setenv("SERVELM_HOME", str(tmp_path / "home"))
    source = resolve_model(str(default_model_path))
    model_class = get_model_class(load_model_config(source).architecture)
    written = []
    for dtype in (torch.float32, torch.bfloat16):
        key = prepared.prepared_key(source, model_class, dtype)
        path = prepared.prepared_dir() / f"{key}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"stale")
        written.append(str(path))
    removed = clear_model_caches(str(default_model_path))
    assert set(written) <= set(removed)
    assert not any(Path(p).exists() for p in written)
