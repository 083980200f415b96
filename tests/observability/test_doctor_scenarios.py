"""`servelm doctor` names the cause of a tail first, in one scenario per suspect.

Each scenario is a live server (the real HTTP front end, scheduler, block manager and prefix
cache; a model-free runner whose step costs 2 ms + 20 us a token, so a long prefill chunk is
a slow step) under a workload that has exactly one fault: a burst, a long prompt among
streams, a KV pool too small, a prefix cache thrashed, a slow reader, a stalled host. The
doctor reads the server's records (`--url`, or `--log` from `--request-log`) and must rank
that fault's suspect first.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time

import httpx
import pytest
from servers import fake_server, word_tokenizer

from servelm.cli import main as servelm_main

STEP_S, PER_TOKEN_S = 0.002, 2e-5
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _quiet_gc():
    """The server, its clients and whatever earlier tests left share this process: freeze
    what exists so a full collection of that heap does not stall a scenario (the doctor would
    rightly name it: GC pauses count as host time). The injected fault must be the only one."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _doctor(capsys, *args: str, fault: bool = True) -> dict:
    """The doctor's JSON; its text report is printed (shown with -s or on failure). With a
    fault injected the tail must be broken and explained."""
    capsys.readouterr()
    assert servelm_main(["doctor", *args]) == 0
    text = capsys.readouterr().out
    assert servelm_main(["doctor", *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    print(text)
    if fault:
        assert out["broken_tail"] and out["explained"], text
    return out


def _complete(c: httpx.Client, prompt, max_tokens: int, stream: bool = False) -> None:
    body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}
    r = c.post("/v1/completions", json=body)
    r.read()
    assert r.status_code == 200, r.text


def _loop(url: str, until: float, prompt_of, max_tokens: int, think_s: float,
          stream: bool = False) -> threading.Thread:
    def run():
        with httpx.Client(base_url=url, timeout=60) as c:
            i = 0
            while time.monotonic() < until:
                _complete(c, prompt_of(i), max_tokens, stream)
                i += 1
                time.sleep(think_s)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _short(i: int, n: int = 24) -> list[int]:
    return [10 + (i * 7 + j) % 900 for j in range(n)]


def test_burst_is_named_queueing(capsys):
    s = fake_server(step_s=STEP_S, per_token_s=PER_TOKEN_S, max_num_seqs=4,
                    max_num_batched_tokens=256)
    try:
        until = time.monotonic() + 4.0
        steady = [_loop(s.url, until, lambda i, k=k: _short(2 * i + k), 8, 0.03)
                  for k in range(2)]
        clients = [httpx.Client(base_url=s.url, timeout=60) for _ in range(40)]
        go = threading.Barrier(len(clients))

        def one(i: int) -> None:
            go.wait()
            _complete(clients[i], _short(1000 + i), 16)

        burst = [threading.Thread(target=one, args=(i,)) for i in range(len(clients))]
        time.sleep(1.5)
        for t in burst:
            t.start()
        for t in burst + steady:
            t.join(60)
        top = _doctor(capsys, "--url", s.url)["suspects"][0]
    finally:
        s.stop()
    assert top["name"] == "queueing", top
    assert top["tail_share"] >= 0.8


def test_long_prompt_among_streams_is_named_long_prefill(capsys, tmp_path):
    log = tmp_path / "requests.jsonl"
    s = fake_server(step_s=STEP_S, per_token_s=PER_TOKEN_S, max_num_batched_tokens=2048,
                    num_blocks=4096, max_model_len=16384, request_log=str(log))
    try:
        until = time.monotonic() + 3.5
        streams = [_loop(s.url, until, lambda i, k=k: _short(i * 6 + k), 8, 0.02, stream=True)
                   for k in range(6)]
        long_ = _loop(s.url, until, lambda i: _short(i, 6000), 1, 0.5)
        for t in streams + [long_]:
            t.join(60)
        out = _doctor(capsys, "--log", str(log))
    finally:
        s.stop()
    top = out["suspects"][0]
    assert top["name"] == "long_prefill", out["suspects"]
    assert "chunk budget 2,048" in top["evidence"] and "--max-num-batched-tokens" in top["advice"]


def test_long_prompt_stalls_streams_tpot(capsys):
    """The same fault seen in TPOT: streams decoding through a long prompt's chunks."""
    s = fake_server(step_s=STEP_S, per_token_s=PER_TOKEN_S, max_num_batched_tokens=2048,
                    num_blocks=4096, max_model_len=16384)
    try:
        until = time.monotonic() + 3.5
        streams = [_loop(s.url, until, lambda i, k=k: _short(i * 4 + k), 48, 0.01, stream=True)
                   for k in range(4)]
        long_ = _loop(s.url, until, lambda i: _short(i, 6000), 1, 0.6)
        for t in streams + [long_]:
            t.join(60)
        out = _doctor(capsys, "--url", s.url, "--metric", "tpot")
    finally:
        s.stop()
    top = out["suspects"][0]
    assert top["name"] == "long_prefill", out["suspects"]
    assert top["tail_share"] >= 0.6


def test_tiny_kv_pool_is_named_preemption(capsys):
    s = fake_server(step_s=STEP_S, per_token_s=PER_TOKEN_S, num_blocks=40, max_num_seqs=8,
                    max_num_batched_tokens=256)
    try:
        until = time.monotonic() + 3.0
        threads = [_loop(s.url, until, lambda i, k=k: _short(i * 8 + k), 48, 0.01)
                   for k in range(6)]
        for t in threads:
            t.join(60)
        out = _doctor(capsys, "--url", s.url)
        preempted = httpx.get(s.url + "/dashboard/data").json()["counters"]["preemptions"]
    finally:
        s.stop()
    assert preempted > 0
    assert out["suspects"][0]["name"] == "preemption", out["suspects"]


def test_cache_thrash_is_named_prefix_cache(capsys):
    s = fake_server(step_s=STEP_S, per_token_s=PER_TOKEN_S, num_blocks=560, prefix_caching=True,
                    max_num_batched_tokens=2048)
    prefix_a = [11 + j % 97 for j in range(1600)]
    prefix_b = [13 + j % 89 for j in range(1600)]
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for i in range(120):
                prefix = prefix_b if i % 12 == 11 else prefix_a
                _complete(c, prefix + _short(i, 8), 4)
        out = _doctor(capsys, "--url", s.url)
        hit_rate = httpx.get(s.url + "/dashboard/data").json()["gauges"]["prefix_hit_rate"]
    finally:
        s.stop()
    assert hit_rate > 0.5  # most requests do hit: the tail is the misses
    assert out["suspects"][0]["name"] == "prefix_cache", out["suspects"]


def _slow_reader(port: int, body: bytes, read_every_s: float, done: list) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    data = b""
    while b"[DONE]" not in data[-64:]:
        time.sleep(read_every_s)
        chunk = sock.recv(256)
        if not chunk:
            break
        data += chunk
    sock.close()
    done.append(len(data))


def test_slow_reader_is_named_slow_client(capsys):
    s = fake_server(step_s=STEP_S, per_token_s=PER_TOKEN_S, tokenizer=word_tokenizer(),
                    sndbuf=4096, write_buffer_high=2048)
    body = json.dumps({"model": "fake", "prompt": "w5 w6 w7 w8", "max_tokens": 200,
                       "ignore_eos": True, "stream": True}).encode()
    done: list[int] = []
    try:
        until = time.monotonic() + 3.0
        fast = [_loop(s.url, until, lambda i: "w1 w2 w3 w4", 120, 0.01, stream=True)
                for _ in range(2)]
        slow = []
        while time.monotonic() < until - 0.8:
            t = threading.Thread(target=_slow_reader, args=(s.port, body, 0.02, done),
                                 daemon=True)
            t.start()
            slow.append(t)
            time.sleep(0.4)
        for t in fast + slow:
            t.join(60)
        out = _doctor(capsys, "--url", s.url, "--metric", "latency")
    finally:
        s.stop()
    assert len(done) == len(slow) and min(done) > 10_000
    top = out["suspects"][0]
    assert top["name"] == "slow_client", out["suspects"]


def test_injected_host_stall_is_named_host(capsys):
    s = fake_server(step_s=STEP_S, per_token_s=PER_TOKEN_S,
                    tokenizer=word_tokenizer(stall_word="STALL", stall_s=0.15))
    try:
        until = time.monotonic() + 3.0
        steady = [_loop(s.url, until, lambda i: "w1 w2 w3 w4 w5 w6", 8, 0.02, stream=True)
                  for _ in range(2)]
        stalls = _loop(s.url, until, lambda i: "w1 STALL w2", 8, 0.35)
        for t in steady + [stalls]:
            t.join(60)
        out = _doctor(capsys, "--url", s.url)
    finally:
        s.stop()
    assert out["suspects"][0]["name"] == "host", out["suspects"]


def test_doctor_refuses_bad_input(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request_id": "a"}\n')
    assert servelm_main(["doctor", "--log", str(bad)]) == 2
    assert "--log" in capsys.readouterr().err
    few = tmp_path / "few.jsonl"
    few.write_text('{"request_id": "a", "arrival": 1.0, "num_prompt_tokens": 3, '
                   '"endpoint": "completion", "status": "finished", "stream": false, '
                   '"arrival_unix": 0, "num_output_tokens": 1, "ttft_s": 0.1}\n')
    assert servelm_main(["doctor", "--log", str(few)]) == 2
    assert "at least 20" in capsys.readouterr().err
    assert servelm_main(["doctor", "--log", str(few), "--quantile", "2"]) == 2
    assert "quantile" in capsys.readouterr().err


def _record(i: int, ttft: float, **kw):
    from servelm.server.dashboard.records import RequestRecord

    fields = dict(request_id=f"r{i}", endpoint="completion", status="finished", stream=False,
                  arrival=i * 0.5, arrival_unix=0.0, num_prompt_tokens=24, num_output_tokens=8,
                  host_s=0.0005, queue_s=0.001, prefill_s=ttft - 0.0015, prefill_wait_s=0.0,
                  ttft_s=ttft, e2e_s=ttft + 0.02, latency_s=ttft + 0.021)
    fields.update(kw)
    return RequestRecord(**fields)


def test_a_tight_tail_or_an_unexplained_one_names_no_cause():
    """Synthetic records: a p99 a few ms over the median is no broken tail; a spread no
    suspect's signature accounts for (long outputs, say) is left unexplained."""
    from servelm.doctor import diagnose

    tight = [_record(i, 0.003 + 0.0001 * (i % 7)) for i in range(100)]
    d = diagnose(tight)
    assert not d.is_broken and not d.is_explained
    assert "no broken tail" in d.render()
    # The tail's own prefill is slow, but its prompt is ordinary and fully uncached like
    # everyone's: no suspect's signature holds.
    spread = [_record(i, 0.003) for i in range(95)] + \
        [_record(95 + i, 0.2, prefill_s=0.1985) for i in range(5)]
    d = diagnose(spread)
    assert d.is_broken and not d.is_explained, d.render()
    assert "No suspect explains" in d.render()
    # The same tail with the waiting moved into the queue during a burst is explained.
    burst = [_record(i, 0.003) for i in range(95)] + \
        [_record(95 + i, 0.2, queue_s=0.198, prefill_s=0.0015, arrival=30.0 + 0.001 * i)
         for i in range(5)]
    d = diagnose(burst)
    assert d.is_explained and d.top.name == "queueing", d.render()
