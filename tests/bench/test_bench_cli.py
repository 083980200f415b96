"""`servelm bench offline` argument handling and orchestration, with a fake peer script."""

import argparse
import json
import sys
import textwrap

import pytest

from servelm.bench import cli
from servelm.bench.results import RequestTiming, build_result


def parse(argv):
    """`bench offline` flags; the models named here do not exist, so their vocabulary is
    given unless the test gives one."""
    parser = argparse.ArgumentParser(prog="servelm")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    vocab = [] if "--vocab-size" in argv else ["--vocab-size", "1000"]
    return parser.parse_args(["bench", "offline"] + argv + vocab)


@pytest.mark.parametrize("flag,value", [("--input-len", "8:2"), ("--output-len", "x"),
                                        ("--input-len", "0"), ("--output-len", "1:2:3")])
def test_bad_ranges_exit_2_naming_the_flag(flag, value, capsys, tmp_path):
    args = parse(["m.gguf", flag, value, "--no-servelm", "--out", str(tmp_path / "r.json")])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert flag in err
    assert not (tmp_path / "r.json").exists()


def test_bad_num_prompts_names_the_flag(capsys, tmp_path):
    args = parse(["m.gguf", "--num-prompts", "0", "--no-servelm"])
    assert args.func(args) == 2
    assert "--num-prompts" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["--peers", "llama.cpp,sglang"], "--peers"),
    (["--peers", "vllm", "--peer-python", "vllm"], "--peer-python"),
    (["--peers", "vllm", "--peer-python", "tgi=/x"], "--peer-python"),
    (["--peers", "vllm", "--peer-model", "vllm=/m"], "--peer-python"),  # no interpreter
    (["--peers", "vllm", "--peer-python", "vllm=/py"], "--peer-model"),  # no model
    (["--step-trace", "steps.jsonl"], "--step-trace"),  # served steps only: refused
])
def test_bad_peer_flags_name_the_flag(argv, flag, capsys):
    args = parse(["m.safetensors-dir", "--no-servelm"] + argv)
    assert args.func(args) == 2
    assert flag in capsys.readouterr().err


def test_gguf_model_is_llama_cpp_default_and_hf_uses_this_python():
    args = parse(["x.gguf", "--peers", "llama.cpp,hf", "--peer-python", "llama.cpp=/py",
                  "--peer-model", "hf=/hfdir", "--threads", "3"])
    assert args.peers == "llama.cpp,hf" and args.num_threads == 3
    cmd = cli.peer_command(args, "llama.cpp", "/py", "x.gguf", "/w.json", "/o.json")
    assert cmd[:2] == ["/py", str(cli.PEERS_SCRIPT)]
    assert cmd[cmd.index("--threads") + 1] == "3"
    assert cmd[cmd.index("--workload") + 1] == "/w.json"


FAKE_PEER = textwrap.dedent("""
    import json, sys
    argv = sys.argv[1:]
    get = lambda flag: argv[argv.index(flag) + 1]
    backend = get("--backend")
    if backend == "vllm":
        sys.stderr.write("RuntimeError: no CPU backend here\\n")
        sys.exit(3)
    workload = json.load(open(get("--workload")))
    n_out = sum(r["max_tokens"] for r in workload["requests"])
    n_in = sum(len(r["prompt_token_ids"]) for r in workload["requests"])
    json.dump({"system": backend, "num_requests": len(workload["requests"]),
               "num_input_tokens": n_in, "num_output_tokens": n_out, "elapsed_s": 2.0,
               "output_tok_s": n_out / 2.0, "total_tok_s": (n_in + n_out) / 2.0,
               "ttft_s": {"mean": 0.1, "p50": 0.1}, "decode_tok_s": 9.0,
               "peak_memory_bytes": 2**20, "machine": {"cpu": "fake", "threads": 2}},
              open(get("--out"), "w"))
""")


def fake_servelm(args, requests):
    timings = [RequestTiming(len(r.prompt_token_ids), r.max_tokens, 0.0, 0.1, 0.5)
               for r in requests]
    return build_result(system="servelm", model=args.model, timings=timings, elapsed_s=1.0,
                        peak_memory_bytes=2**20)


def test_runs_every_system_in_turn_and_writes_json_png_and_table(monkeypatch, tmp_path,
                                                                 capsys):
    script = tmp_path / "fake_peers.py"
    script.write_text(FAKE_PEER)
    monkeypatch.setattr(cli, "PEERS_SCRIPT", script)
    monkeypatch.setattr(cli, "run_servelm", fake_servelm)
    out = tmp_path / "res" / "r.json"
    py = sys.executable
    args = parse(["m.gguf", "--num-prompts", "4", "--input-len", "8:16", "--output-len", "5",
                  "--peers", "llama.cpp,vllm,hf",
                  f"--peer-python=llama.cpp={py},vllm={py}", "--peer-model",
                  "vllm=/hf,hf=/hf", "--out", str(out), "--no-progress"])
    assert args.func(args) == 1  # one peer failed
    results = json.loads(out.read_text())
    assert [r["system"] for r in results] == ["servelm", "llama.cpp", "vllm", "hf"]
    # every system saw the same workload
    assert {r["workload"]["num_input_tokens"] for r in results} == \
        {results[0]["num_input_tokens"]}
    assert results[1]["num_output_tokens"] == 20
    assert results[2]["error"].startswith("exit 3: RuntimeError: no CPU backend here")
    assert out.with_suffix(".png").stat().st_size > 1000
    table = capsys.readouterr().out
    assert "FAILED: exit 3" in table
    assert table.count("\n") >= 6


def test_servelm_failure_does_not_hide_peers(monkeypatch, tmp_path):
    def broken(args, requests):
        raise RuntimeError("engine not ready")

    script = tmp_path / "fake_peers.py"
    script.write_text(FAKE_PEER)
    monkeypatch.setattr(cli, "PEERS_SCRIPT", script)
    monkeypatch.setattr(cli, "run_servelm", broken)
    out = tmp_path / "r.json"
    args = parse(["m.gguf", "--num-prompts", "2", "--peers", "llama.cpp",
                  f"--peer-python=llama.cpp={sys.executable}", "--out", str(out),
                  "--no-progress"])
    assert args.func(args) == 1
    results = json.loads(out.read_text())
    assert results[0] == {**results[0], "system": "servelm",
                          "error": "RuntimeError: engine not ready"}
    assert results[1]["output_tok_s"] > 0


def test_a_small_vocabulary_model_gets_prompts_inside_its_vocabulary(monkeypatch, tmp_path,
                                                                     tiny_hf):
    """No --vocab-size: the ids come from the model's own vocabulary (384 here, not the
    default model's 49,152), and servelm generates the whole workload."""
    from tiny_models import save_tiny_checkpoint

    model_dir = save_tiny_checkpoint(tiny_hf("llama", vocab_size=384), tmp_path / "tiny")
    drawn = []
    real = cli.run_servelm

    def recording(args, requests):
        drawn.extend(requests)
        return real(args, requests)

    monkeypatch.setattr(cli, "run_servelm", recording)
    out = tmp_path / "r.json"
    rc = cli.main(["offline", str(model_dir), "--num-prompts", "4", "--input-len", "8:24",
                   "--output-len", "3", "--no-progress", "--no-prepared-weights-cache",
                   "--out", str(out)])
    (result,) = json.loads(out.read_text())
    assert rc == 0 and "error" not in result, result.get("error")
    assert result["workload"]["vocab_size"] == 384
    assert len(drawn) == 4 and max(t for r in drawn for t in r.prompt_token_ids) < 384
    assert result["num_output_tokens"] == 4 * 3


def test_a_model_whose_vocabulary_cannot_be_read_asks_for_the_flag(capsys, tmp_path):
    rc = cli.main(["offline", str(tmp_path / "missing.gguf"), "--no-servelm", "--out",
                   str(tmp_path / "r.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--vocab-size" in err and "missing.gguf" in err


def test_default_out_path_is_timestamped_under_benchmarks_results():
    import datetime

    now = datetime.datetime(2026, 11, 30, 1, 2, 3, tzinfo=datetime.timezone.utc)
    assert str(cli.default_out_path(now)) == "benchmarks/results/offline-20261130T010203Z.json"
