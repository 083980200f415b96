"""The C++ CPU kernels' build contract: built once per machine and reused by later processes;
a failed build warns once and every user keeps its torch path; mode 'kernel' fails loudly.
"""

import logging
import subprocess
import sys

import pytest
import torch

from servelm import cpu_kernels
from servelm.attention import paged_attention_cpu
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.config import ModelConfig
from servelm.layers import fused_cpu
from servelm.layers.norm import RMSNorm
from servelm.runner.kv_cache import KVCache


def test_a_second_process_reuses_the_build():
    cpu_kernels.load()  # built (or found) by this process
    from servelm.loader.model_cache import cache_home

    build = cache_home() / "torch_extensions" / f"servelm_cpu_kernels_{cpu_kernels._build_key()}"
    libraries = list(build.glob("*.so"))
    assert len(libraries) == 1
    before = libraries[0].stat().st_mtime_ns
    code = ("import torch; from servelm import cpu_kernels; ops = cpu_kernels.load(); "
            "print(ops.silu_and_mul(torch.zeros(1, 32)).shape)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "torch.Size([1, 16])"
    assert libraries[0].stat().st_mtime_ns == before  # loaded, not rebuilt


@pytest.fixture
def broken_build(monkeypatch):
    """A machine without a compiler: the loader's once-per-process state starts fresh and is
    restored after the test."""
    calls = []

    def build():
        calls.append(1)
        raise RuntimeError("Error building extension: c++: not found")

    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    monkeypatch.setattr(cpu_kernels, "_warned", False)
    monkeypatch.setattr(cpu_kernels, "_build", build)
    return calls


def test_failed_build_warns_once_and_keeps_the_torch_paths(broken_build, monkeypatch, caplog):
    monkeypatch.setenv(paged_attention_cpu.ENV_VAR, "auto")
    monkeypatch.setenv(fused_cpu.ENV_VAR, "auto")
    config = ModelConfig("llama", 32, 64, 64, 1, 4, 2, 16, 64)
    x = torch.randn(3, 64)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        backends = [TorchAttentionBackend(KVCache(config, 8, 4, torch.float32,
                                                  torch.device("cpu")), 4, 0.25)
                    for _ in range(2)]
        out = RMSNorm(64)(x)
    assert all(b.decode_kernel is None for b in backends)
    assert fused_cpu.fused_ops(x) is None
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert len(broken_build) == 1  # tried once per process
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "c++: not found" in warnings[0].getMessage()


def test_failed_build_in_kernel_mode_is_an_error(broken_build, monkeypatch):
    monkeypatch.setenv(fused_cpu.ENV_VAR, "kernel")
    with pytest.raises(RuntimeError, match="c\\+\\+: not found"):
        fused_cpu.fused_ops(torch.zeros(2, 16))
    monkeypatch.setenv(paged_attention_cpu.ENV_VAR, "kernel")
    with pytest.raises(RuntimeError, match="c\\+\\+: not found"):
        paged_attention_cpu.decode_kernel_for(torch.empty(1, 4, 2, 16))


def test_torch_mode_never_builds(broken_build, monkeypatch):
    monkeypatch.setenv(fused_cpu.ENV_VAR, "torch")
    assert fused_cpu.fused_ops(torch.zeros(2, 16)) is None
    assert broken_build == []


def test_a_bad_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv(fused_cpu.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=fused_cpu.ENV_VAR):
        fused_cpu.fused_ops(torch.zeros(2, 16))
