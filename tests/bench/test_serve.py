"""`servelm bench serve` end to end: the CLI against the fake server (report, sweep and
plot), and against the real `servelm serve` with the default model."""

import gc
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from servelm.bench.cli import main
from servelm.bench.fake_server import FakeBehaviour, FakeServer

MODEL = "smollm2-135m-instruct"
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
STAT_KEYS = ("mean", "p50", "p90", "p95", "p99")


def check_report(res: dict) -> None:
    """Fields present and consistent with each other."""
    for key in ("command", "machine", "commit", "load", "workload", "failures", "slo",
                "client", "request_throughput", "output_tok_s", "total_tok_s", "goodput"):
        assert key in res, key
    assert "serve" in res["command"]
    for key in LATENCY_KEYS:
        assert all(res[key][s] is not None for s in STAT_KEYS), key
        s = res[key]
        assert s["p50"] <= s["p90"] <= s["p95"] <= s["p99"] <= s["max"]
    assert 0.0 <= res["goodput"] <= 1.0
    assert res["num_good"] <= res["num_completed"] <= res["num_requests"]
    assert res["num_completed"] + res["num_failed"] == res["num_requests"]
    assert sum(res["failures"].values()) == res["num_failed"]
    assert res["ttft_ms"]["p50"] <= res["e2e_ms"]["p50"]
    assert res["output_tok_s"] == pytest.approx(res["num_output_tokens"] / res["elapsed_s"])


def test_cli_report_against_the_fake_server(tmp_path, capsys):
    out = tmp_path / "r.json"
    with FakeServer(FakeBehaviour(ttft_s=0.05, tpot_s=0.01, fail_every=5)) as server:
        rc = main(["serve", "--base-url", server.url, "--model", "fake", "--request-rate", "50",
                   "--vocab-size", "1000", "--num-prompts", "12", "--warmup", "1",
                   "--output-len", "6",
                   "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--out", str(out),
                   "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    check_report(res)
    # Requests 5, 10 (counting the warm-up as 1) fail with 500.
    assert res["failures"] == {"http_500": 2} and res["num_requests"] == 12
    assert res["num_output_tokens"] == res["num_expected_output_tokens"] == 10 * 6
    assert res["goodput"] == pytest.approx(10 / 12)
    assert res["load"]["request_rate"] == 50 and res["load"]["num_warmup"] == 1
    table = capsys.readouterr().out
    assert "TTFT" in table and "TPOT" in table and "goodput" in table and "http_500=2" in table


@pytest.fixture
def frozen_heap():
    """The sweep times requests inside this process (client and fake server): a full garbage
    collection of everything the test session has loaded by then (a fresh-clone run saw two
    of twelve low-rate requests 0.5 s late) would land in its latencies. Frozen objects are
    not traversed again."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def test_sweep_draws_the_curve_and_finds_where_goodput_drops(tmp_path, capsys, frozen_heap):
    out = tmp_path / "sweep.json"
    # Two slots, 0.12 s per request: ~16 req/s capacity; 60 req/s queues up. At 5 req/s a
    # request can still wait for a slot (up to 0.12 s) when three arrive together, so the
    # TTFT SLO leaves room for that: it separates the rates by the queue, not by jitter.
    with FakeServer(FakeBehaviour(ttft_s=0.02, tpot_s=0.01, capacity=2)) as server:
        rc = main(["serve", "--base-url", server.url, "--sweep-rates", "5,60",
                   "--vocab-size", "1000", "--num-prompts", "12", "--warmup", "2",
                   "--output-len", "10",
                   "--slo-ttft-ms", "300", "--slo-tpot-ms", "50", "--out", str(out),
                   "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "serve_sweep" and len(res["runs"]) == 2
    for run in res["runs"]:
        check_report(run)
    s = res["summary"]
    assert s["rates"] == [5, 60] and s["goodput_target"] == 0.9
    low, high = s["points"]
    assert low["goodput"] > high["goodput"]
    assert high["ttft_p99_ms"] > 300  # the queue shows up in TTFT, not TPOT
    assert s["first_rate_below_target"] == 60
    png = out.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    assert "knee" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [
    ["--sweep-rates", "1,x"], ["--sweep-rates", "0,1"], ["--request-rate", "0"],
    ["--concurrency", "2", "--input-len", "9:3"], ["--request-rate", "1", "--extra-body", "[1"],
    ["--request-rate", "1", "--arrival", "burst", "--burst-size", "0"],
    [],  # no load given for the random workload
])
def test_bad_flags_exit_2_naming_the_flag(flags, capsys):
    assert main(["serve", "--base-url", "http://127.0.0.1:9", "--no-progress", *flags]) == 2
    assert "error: --" in capsys.readouterr().err


# --- against the real server ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def servelm_server(default_model_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "servelm.cli", "serve", MODEL, "--port", str(port),
           "--kv-cache-memory", "256MiB", "--no-log-requests"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ready, lines = threading.Event(), []

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "[servelm] serving" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120):
        proc.kill()
        raise RuntimeError("servelm serve did not start:\n" + "".join(lines))
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_against_servelm_serve(servelm_server, tmp_path):
    out = tmp_path / "real.json"
    rc = main(["serve", "--base-url", servelm_server, "--model", MODEL, "--request-rate", "4",
               "--num-prompts", "4", "--warmup", "1", "--input-len", "16:48",
               "--output-len", "6", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    check_report(res)
    assert res["num_completed"] == 4 and res["failures"] == {}
    assert res["num_without_usage"] == 0  # servelm sends the usage chunk
    # ignore_eos + min_tokens: the server generated exactly what was asked, and its usage
    # counts the token-id prompts exactly as sent.
    assert res["num_output_tokens"] == res["num_expected_output_tokens"] == 4 * 6
    assert res["num_input_tokens"] == res["workload"]["num_input_tokens"]
    assert "warning" not in res
    assert MODEL in res["server"]["models"] and res["server"]["version"]
    startup = res["server"]["startup"]  # the server's start-up stages, from its /metrics
    assert startup["ready_s"] > 0 and {"imports", "weights_read", "warmup"} <= set(
        startup["stages_s"])
    assert sum(startup["stages_s"].values()) == pytest.approx(startup["ready_s"], rel=0.05,
                                                              abs=0.1)


@pytest.mark.slow
def test_chat_text_prompts_against_servelm_serve(servelm_server, tmp_path):
    out = tmp_path / "chat.json"
    rc = main(["serve", "--base-url", servelm_server, "--model", MODEL, "--concurrency", "2",
               "--num-prompts", "2", "--warmup", "0", "--endpoint", "chat",
               "--workload", "conversation", "--input-len", "8:24", "--output-len", "4",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["num_completed"] == 2 and res["workload"]["prompt_format"] == "text"
    assert res["num_output_tokens"] == res["num_expected_output_tokens"]
    assert 0.0 <= res["goodput"] <= 1.0


def test_document_batch_is_submitted_at_once(tmp_path):
    out = tmp_path / "docs.json"
    with FakeServer(FakeBehaviour(ttft_s=0.05, tpot_s=0.01, capacity=2)) as server:
        rc = main(["serve", "--base-url", server.url, "--workload", "documents",
                   "--vocab-size", "1000", "--num-prompts", "6", "--input-len", "40:60",
                   "--output-len", "5",
                   "--warmup", "0", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["load"]["request_rate"] == "inf" and res["num_completed"] == 6
    assert res["workload"]["kind"] == "documents"
    # Two at a time, ~0.09 s each: the batch lasts to the last completion (~3 rounds).
    assert res["elapsed_s"] >= 3 * (0.05 + 4 * 0.01)
    assert res["ttft_ms"]["max"] >= 2 * (0.05 + 4 * 0.01) * 1e3  # the last pair queued
