"""The instruction-set probe (cpu_kernels/isa.py) and `--dtype auto` (dtype_choice.py); the
kernels' build lock is tested in test_build.py."""

from __future__ import annotations

import json

import pytest

from servelm import dtype_choice
from servelm.cpu_kernels import isa
from servelm.loader import ModelSource


@pytest.fixture
def fresh_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELM_HOME", str(tmp_path))
    isa.probe.cache_clear()
    yield tmp_path
    isa.probe.cache_clear()


def test_probe_runs_what_is_advertised_and_caches_it(fresh_probe):
    result = isa.probe()
    flags = isa.advertised()
    if not flags or not result["checked"]:
        pytest.skip(f"no probe on this machine: {result['note']}")
    usable = result["usable"]
    assert set(usable) == set(isa.PROBED)
    assert all(not ok or name in flags for name, ok in usable.items())  # never beyond flags
    assert usable["avx2"] == ("avx2" in flags)  # every x86-64 CPU this project meets runs it
    cached = list((fresh_probe / "isa").glob("probe-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text()) == result
    assert "probed by running it" in isa.describe()
    with pytest.raises(ValueError, match="not probed"):
        isa.usable("avx9000")


def test_without_a_compiler_amx_is_off_and_vectors_are_trusted(fresh_probe, monkeypatch):
    monkeypatch.setattr(isa.shutil, "which", lambda name: None)
    result = isa.probe()
    flags = isa.advertised()
    assert not result["checked"] and "no C compiler" in result["note"]
    assert not result["usable"]["amx_bf16"] and not result["usable"]["amx_int8"]
    assert result["usable"]["avx512f"] == ("avx512f" in flags)
    assert not list((fresh_probe / "isa").glob("*.json"))  # a guess is not cached


def _hf_dir(tmp_path, dtype):
    d = tmp_path / dtype
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
    return ModelSource("hf", d, "m")


def test_auto_dtype_follows_the_cpu_and_the_checkpoint(tmp_path, monkeypatch):
    assert dtype_choice.resolve("float32", "cpu", None) == ("float32", "as requested")
    monkeypatch.setattr(isa, "has_bf16_math", lambda: True)
    monkeypatch.setattr(isa, "usable", lambda name: name == "avx512_bf16")
    dtype, why = dtype_choice.resolve("auto", "cpu", _hf_dir(tmp_path, "bfloat16"))
    assert dtype == "bfloat16" and "avx512_bf16" in why and "bfloat16" in why
    gguf = ModelSource("gguf", tmp_path / "absent.gguf", "m")  # not read: the rule comes first
    dtype, why = dtype_choice.resolve("auto", "cpu", gguf, "gguf", "float")
    assert dtype == "float32" and "take float32 rows" in why
    # a float32 checkpoint, or weights handed in, stay float32
    assert dtype_choice.resolve("auto", "cpu", _hf_dir(tmp_path, "float32"))[0] == "float32"
    assert dtype_choice.resolve("auto", "cpu", None)[0] == "float32"
    monkeypatch.setattr(isa, "has_bf16_math", lambda: False)
    dtype, why = dtype_choice.resolve("auto", "cpu", _hf_dir(tmp_path, "float16"))
    assert dtype == "float32" and "no usable bfloat16" in why
    with pytest.raises(ValueError, match="dtype must be one of"):
        dtype_choice.resolve("fp4", "cpu", None)


def test_the_default_gguf_is_stored_quantized(default_model_path):
    source = ModelSource("gguf", default_model_path, "smollm2-135m-instruct")
    assert dtype_choice.stored_dtype(source) == "Q4_1"
