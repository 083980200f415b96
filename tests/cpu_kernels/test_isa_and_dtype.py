"""The instruction-set probe (cpu_kernels/isa.py), `--dtype auto` (dtype_choice.py) and the
kernels' stale build lock."""

from __future__ import annotations

import json
import os
import time

import pytest

from servelm import cpu_kernels, dtype_choice
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
    assert dtype_choice.resolve("auto", "cpu", gguf, deterministic=True)[0] == "float32"
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


def test_a_stale_build_lock_is_cleared_and_a_live_one_kept(tmp_path):
    (tmp_path / "lock").write_text("")
    (tmp_path / "half_built.o").write_text("")
    cpu_kernels._clear_stale_lock(tmp_path)
    assert (tmp_path / "lock").exists()  # young: a build may be running
    old = time.time() - cpu_kernels._STALE_LOCK_S - 60
    os.utime(tmp_path / "lock", (old, old))
    cpu_kernels._clear_stale_lock(tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_waited_for_build_that_left_no_library_is_built_here(tmp_path, monkeypatch):
    """A process that waited on a build whose builder was killed (and its lock cleared) is
    told the build is done, finds no library, and builds it itself."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_kernels, "_build_dir", lambda: tmp_path / "kernels_x")
    calls = []

    def fake_load(name, sources, build_directory, **kw):
        calls.append(name)
        if len(calls) == 1:  # the waiter's load: the lock went, no library came
            raise OSError(f"Could not load this library: {build_directory}/{name}.so")
        (tmp_path / "kernels_x" / f"{name}.so").write_text("")  # this process's own build

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    cpu_kernels._build()
    assert calls == ["kernels_x", "kernels_x"]
    assert (tmp_path / "kernels_x" / "kernels_x.so").exists()

    calls.clear()  # a library that exists but does not load is an error, not a rebuild loop

    def broken_load(name, sources, build_directory, **kw):
        calls.append(name)
        raise OSError("undefined symbol")

    monkeypatch.setattr(cpp_extension, "load", broken_load)
    with pytest.raises(OSError, match="undefined symbol"):
        cpu_kernels._build()
    assert calls == ["kernels_x"]
