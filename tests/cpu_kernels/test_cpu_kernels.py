"""The C++ CPU kernels' build contract: built once per machine and reused by later processes;
a failed build warns once and every user keeps its torch path; mode 'kernel' fails loudly;
one engine option (`--cpu-kernels`) chooses each part's path and the start-up log says which
path each part took.
"""

import logging
import subprocess
import sys

import pytest
import torch

from servelm import cpu_kernels
from servelm.attention import paged_attention_cpu
from servelm.attention.kv_cache import KVCache
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.config import EngineArgs, ModelConfig
from servelm.cpu_kernels import CpuKernelChoice
from servelm.layers import fused_cpu
from servelm.layers.norm import RMSNorm


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


def test_failed_build_warns_once_and_keeps_the_torch_paths(broken_build, cpu_kernel_mode,
                                                           caplog):
    cpu_kernel_mode(paged_attention_cpu.PART, "auto")
    cpu_kernel_mode(fused_cpu.PART, "auto")
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


def test_failed_build_in_kernel_mode_is_an_error(broken_build, cpu_kernel_mode):
    cpu_kernel_mode(fused_cpu.PART, "kernel")
    with pytest.raises(RuntimeError, match="c\\+\\+: not found"):
        fused_cpu.fused_ops(torch.zeros(2, 16))
    cpu_kernel_mode(paged_attention_cpu.PART, "kernel")
    with pytest.raises(RuntimeError, match="c\\+\\+: not found"):
        paged_attention_cpu.decode_kernel_for(torch.empty(1, 4, 2, 16))


def test_torch_mode_never_builds(broken_build, cpu_kernel_mode):
    cpu_kernel_mode(fused_cpu.PART, "torch")
    assert fused_cpu.fused_ops(torch.zeros(2, 16)) is None
    assert broken_build == []


def test_one_engine_option_chooses_every_part(monkeypatch, caplog):
    choice = CpuKernelChoice.parse("torch,decode=kernel")
    assert (choice.attention, choice.decode, choice.layer_ops, choice.quant) == \
        ("torch", "kernel", "torch", "torch")
    assert CpuKernelChoice.parse("attention=torch") == CpuKernelChoice(attention="torch")
    assert str(CpuKernelChoice.parse("auto")) == "auto"
    for bad, named in (("fast", "'fast'"), ("decode=fast", "decode='fast'"),
                       ("stack=torch", "'stack'"), ("attention=torch,auto", "'auto'")):
        with pytest.raises(ValueError, match=named):
            CpuKernelChoice.parse(bad)
    with pytest.raises(ValueError, match="cpu_kernels"):  # EngineArgs checks it at once
        EngineArgs(model="m", cpu_kernels="fast")
    # The old environment variables choose nothing; setting one is called out.
    monkeypatch.setenv("SERVELM_CPU_DECODE", "torch")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        cpu_kernels.configure(CpuKernelChoice())
    assert cpu_kernels.mode("decode") == "auto"
    assert any("SERVELM_CPU_DECODE=torch" in r.getMessage() and "--cpu-kernels" in
               r.getMessage() for r in caplog.records)


def test_cpu_kernels_flag_is_in_help_and_reaches_engine_args():
    import argparse

    from servelm.config import add_engine_cli_args, engine_args_from_cli

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_cli_args(parser)
    assert "--cpu-kernels" in parser.format_help()
    args = engine_args_from_cli(parser.parse_args(["m", "--cpu-kernels", "quant=torch"]))
    assert args.cpu_kernel_choice() == CpuKernelChoice(quant="torch")
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--cpu-kernels", "fast"])


@pytest.mark.parametrize("option,expected", [
    ("auto", "attention=kernel decode=stack layer_ops=fused quant=panels gemm=none"),
    ("torch", "attention=torch decode=eager layer_ops=torch quant=aten gemm=none"),
    ("decode=torch,quant=torch",
     "attention=kernel decode=eager layer_ops=fused quant=aten gemm=none"),
])
def test_start_up_log_says_which_path_each_part_took(tiny_hf, tiny_engine, caplog, option,
                                                      expected):
    with caplog.at_level(logging.INFO, logger="servelm.engine_builder"):
        engine = tiny_engine(tiny_hf("llama"), quantization="int8", cpu_kernels=option)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu kernels")]
    assert lines == [f"cpu kernels (--cpu-kernels {CpuKernelChoice.parse(option)}): {expected}"]
    assert (engine.runner.cpu_stack is None) == ("decode=eager" in expected)


def test_import_servelm_leaves_the_environment_alone():
    code = ("import os; before = dict(os.environ); import servelm, servelm.config, "
            "servelm.cost; print(dict(os.environ) == before)")
    env = {k: v for k, v in __import__("os").environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=env)
    assert out.stdout.strip() == "True"
