"""The CLI: every subcommand's --json fields, errors that name the flag (exit 2), wiring."""

import argparse
import ast
import json
import pathlib
import subprocess
import sys

import pytest

from servelm.planner import cli

# Stable --json fields per subcommand (documented in docs/planner.md).
REQUIRED = {
    "kv": ["kv_bytes_per_token", "kv_bytes_per_request"],
    "weights": ["total_params", "active_params", "weight_bytes"],
    "capacity": ["max_concurrent_users", "kv_token_capacity"],
    "decode": ["step_time_s", "ridge_batch"],
    "prefill": ["prefill_time_s", "tokens_within_budget"],
    "spec": ["expected_tokens_per_step", "break_even_batch"],
    "disagg": ["kv_transfer_bytes", "transfer_time_s", "break_even_bandwidth_Bps"],
    "offload": ["reload_time_s", "recompute_time_s", "crossover_bandwidth_Bps"],
    "fleet": ["num_gpus", "num_replicas"],
    "batch": ["sequential_time_s", "batched_time_s", "memory_batch", "batch_size",
              "num_waves", "break_even_window_s"],
    "coldstart": ["total_s", "storage_read_s", "host_to_gpu_s", "runtime_init_s",
                  "warmup_s", "graph_capture_s"],
}


def run(capsys, *argv):
    code = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("command", list(REQUIRED))
def test_json_fields(capsys, command):
    code, out, _ = run(capsys, command, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["command"] == command
    for name in REQUIRED[command]:
        assert name in data
    assert data["steps"] and all({"name", "formula", "substituted", "value", "unit"} <= set(s)
                                 for s in data["steps"])


@pytest.mark.parametrize("command", list(REQUIRED))
def test_text_shows_the_formula_chain(capsys, command):
    code, out, _ = run(capsys, command)
    assert code == 0
    assert out.startswith(f"servelm plan {command}:")
    assert out.count(" = ") >= 3  # formula line, numbers plugged in, result


def test_kv_json_values(capsys):
    _, out, _ = run(capsys, "kv", "--model", "Llama-3.1-70B", "--context", "131072", "--json")
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 327680
    assert len(data["layouts"]) == 4


def test_capacity_defaults_to_one_replica(capsys):
    _, out, _ = run(capsys, "capacity", "--model", "Llama-3.1-70B", "--num-gpus", "8",
                    "--json")
    data = json.loads(out)
    assert data["inputs"]["tp"] == 8 and data["num_replicas"] == 1


def test_infinity_becomes_null(capsys):
    _, out, _ = run(capsys, "decode", "--context", "32768", "--json")
    assert json.loads(out)["ridge_batch"] is None


def test_calibration_flag(capsys, tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"bandwidth_fraction": 0.5}))
    _, base, _ = run(capsys, "decode", "--batch", "1", "--context", "1", "--json")
    _, slow, _ = run(capsys, "decode", "--batch", "1", "--context", "1", "--json",
                     "--calibration", str(cal))
    assert json.loads(slow)["step_time_s"] == pytest.approx(2 * json.loads(base)["step_time_s"])
    assert json.loads(slow)["inputs"]["calibration"] == str(cal)


def test_model_from_config_path(capsys, tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run(capsys, "kv", "--model", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["kv_bytes_per_token"] == 2 * 2 * 64 * 2


@pytest.mark.parametrize("argv,flag", [
    (["decode", "--gpu", "X100"], "--gpu"),
    (["decode", "--model", "GPT-9"], "--model"),
    (["disagg", "--link", "carrier-pigeon"], "--link"),
    (["offload", "--tier", "tape"], "--tier"),
    (["capacity", "--num-gpus", "8", "--tp", "3"], "--tp"),
    (["decode", "--calibration", "/nonexistent.json"], "--calibration"),
])
def test_bad_values_exit_2_naming_the_flag(capsys, argv, flag):
    code, out, err = run(capsys, *argv)
    assert code == 2 and flag in err and out == ""


@pytest.mark.parametrize("argv,flag", [
    (["decode", "--batch", "-3"], "--batch"),
    (["prefill", "--tokens", "0"], "--tokens"),
    (["spec", "--acceptance", "1.5"], "--acceptance"),
    (["capacity", "--mem-util", "0"], "--mem-util"),
    (["capacity", "--reserve-gb", "-1"], "--reserve-gb"),
    (["fleet", "--rps", "abc"], "--rps"),
])
def test_argparse_rejects_out_of_range(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", *argv])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_add_parser_sets_func():
    parser = argparse.ArgumentParser(prog="servelm")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "weights", "--model", "SmolLM2-135M"])
    assert args.func is cli.handler


def test_catalog_lists_sources(capsys):
    code, out, _ = run(capsys, "catalog", "--json")
    data = json.loads(out)
    assert code == 0 and "DeepSeek-V3" in data["models"] and "B200" in data["gpus"]
    assert all(g["sources"] for g in data["gpus"].values())


def test_no_torch_anywhere_in_the_planner():
    root = pathlib.Path(cli.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] == "torch" for n in names), path
    # At run time too: the planner adds no torch to whatever `servelm` itself imports.
    code = ("import sys, servelm; before = 'torch' in sys.modules; "
            "import servelm.planner.cli; sys.exit(int('torch' in sys.modules and not before))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
