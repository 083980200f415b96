"""Prepared weights (servelm/loader/prepared.py): the first build writes the finished float
parameters, the next reads them instead of the checkpoint, and gives the same model."""

import pytest
import torch

from servelm.config import EngineArgs
from tiny_models import greedy, save_tiny_checkpoint

PROMPT = (5, 9, 17, 33, 2, 8)


@pytest.fixture
def hf_dir(tmp_path, tiny_hf):
    return save_tiny_checkpoint(tiny_hf("llama", seed=3), tmp_path / "tiny-llama")


@pytest.fixture
def home(tmp_path, monkeypatch):
    from servelm.loader import prepared

    monkeypatch.setenv("SERVELM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(prepared, "MIN_BYTES", 0)  # the tiny checkpoint counts
    return tmp_path / "home"


def _build(path, **kw):
    from servelm.engine_builder import build_engine

    return build_engine(EngineArgs(model=str(path), num_blocks=64, block_size=4, **kw))


def _state(engine):
    return {k: v.to_dense() if v.is_mkldnn else v.clone()  # PackedLinear: oneDNN layout
            for k, v in engine.runner.model.state_dict().items()}


def _entries(home):
    return sorted((home / "prepared").glob("*.safetensors"))


def test_second_build_reads_the_prepared_weights_and_matches(hf_dir, home):
    from servelm import startup

    first = _build(hf_dir)
    assert "weights_cache" in startup.timer().stages
    assert startup.timer().notes.get("weights_read") is None
    (entry,) = _entries(home)
    second = _build(hf_dir)
    assert startup.timer().notes.get("weights_read") == "prepared-weights cache"
    assert "weights_cache" not in startup.timer().stages
    assert _entries(home) == [entry]
    a, b = _state(first), _state(second)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert greedy(first, PROMPT, 8) == greedy(second, PROMPT, 8)


def test_off_by_flag_and_for_quantized_builds(hf_dir, home):
    _build(hf_dir, prepared_weights_cache=False)
    assert _entries(home) == []
    _build(hf_dir, quantization="int8")
    assert _entries(home) == []


def test_key_follows_the_checkpoint_the_dtype_and_the_code(hf_dir, home, monkeypatch):
    from servelm.loader import load_model_config, prepared, resolve_model
    from servelm.models import get_model_class

    source = resolve_model(str(hf_dir))
    cls = get_model_class(load_model_config(source).architecture)
    key = prepared.prepared_key(source, cls, torch.float32)
    assert key == prepared.prepared_key(source, cls, torch.float32)
    assert key != prepared.prepared_key(source, cls, torch.bfloat16)
    monkeypatch.setattr(prepared, "code_hash", lambda: "another servelm")
    assert key != prepared.prepared_key(source, cls, torch.float32)
    monkeypatch.undo()
    monkeypatch.setenv("SERVELM_HOME", str(home))
    (weights,) = hf_dir.glob("*.safetensors")
    weights.touch()  # a rewritten checkpoint: a new modification time
    assert key != prepared.prepared_key(source, cls, torch.float32)


def test_a_corrupt_entry_falls_back_to_the_checkpoint(hf_dir, home, caplog):
    from servelm import startup

    reference = greedy(_build(hf_dir), PROMPT, 8)
    (entry,) = _entries(home)
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # a torn file
    with caplog.at_level("WARNING"):
        engine = _build(hf_dir)
    assert "unreadable prepared weights" in caplog.text
    assert startup.timer().notes.get("weights_read") is None
    assert greedy(engine, PROMPT, 8) == reference


def test_eviction_keeps_the_cache_under_its_cap(tmp_path, home, tiny_hf, monkeypatch):
    from servelm.loader import prepared

    paths = []
    for seed in range(3):
        paths.append(save_tiny_checkpoint(tiny_hf("llama", seed=seed), tmp_path / f"m{seed}"))
    _build(paths[0])
    size = _entries(home)[0].stat().st_size
    monkeypatch.setattr(prepared, "CAP_BYTES", int(2.5 * size))
    _build(paths[1])
    _build(paths[2])
    entries = _entries(home)
    assert len(entries) == 2
    assert sum(e.stat().st_size for e in entries) <= prepared.CAP_BYTES
