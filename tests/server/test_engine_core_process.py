"""The engine core in its own process: same outputs as in-process, and clean failure when
either process dies (killed with SIGKILL mid-load)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from live_server import MODEL, LiveServer
from serve_process import ServeProcess

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "List three colors:"]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _core_pid(frontend_pid: int) -> int:
    cores = [c for c in _children(frontend_pid)
             if b"servelm.core_process.process" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(cores) == 1, cores
    return cores[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a dead parent's init) is not alive either.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"


def _wait(cond, timeout: float) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


class _Stream(threading.Thread):
    """A long streaming completion read in the background; records every SSE event."""

    def __init__(self, url: str, prompt: str = "Tell me a story"):
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.events: list[str] = []
        self.error_time: float | None = None
        self.first_token = threading.Event()

    def run(self):
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": 1000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    self.events.append(line[6:])
                    if '"error"' in line and self.error_time is None:
                        self.error_time = time.monotonic()
                    if '"text"' in line:
                        self.first_token.set()
        except httpx.HTTPError as exc:
            self.events.append(f"transport error: {exc!r}")
        self.first_token.set()


def test_greedy_outputs_through_the_core_process_match_the_in_process_engine(engine):
    from servelm import LLM, SamplingParams

    # float32 as the fixture engine: `--dtype auto` takes bfloat16 on a CPU with bfloat16
    # math, and greedy text then parts ways with float32's a few tokens in
    srv = ServeProcess("--dtype", "float32")
    try:
        core = _core_pid(srv.proc.pid)
        assert _alive(core)
        served = []
        for prompt in PROMPTS:  # one at a time: the same batch shapes as the LLM run below
            r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            served.append(r.json()["choices"][0]["text"])
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
    _wait(lambda: not _alive(core), 10)
    llm = LLM(engine=engine)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    local = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]
    assert served == local


def test_a_dead_core_fails_in_flight_requests_and_health_says_why(default_model_path):
    """Each in-flight stream gets an error event naming the cause, then [DONE]: the front
    end learns of the death from the socket's EOF, so the streams end rather than wait."""
    from servelm.config import EngineArgs
    from servelm.core_process.client import CoreClient
    from servelm.loader import load_tokenizer, resolve_model

    args = EngineArgs(model=MODEL, kv_cache_memory=64 * 2**20)
    client = CoreClient.spawn(args, load_tokenizer(resolve_model(MODEL)))
    server = LiveServer(client)
    try:
        streams = [_Stream(server.url, p) for p in PROMPTS[:2]]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first_token.wait(30) and s.events, s.events
        assert httpx.get(server.url + "/health").status_code == 200
        os.kill(client.proc.pid, signal.SIGKILL)
        for s in streams:
            s.join(60)  # a deadline on the wait, not on how fast the error comes
            assert not s.is_alive(), "a stream kept waiting after its core died"
            assert s.error_time is not None, s.events[-3:]
            err = json.loads(next(e for e in s.events if '"error"' in e))["error"]
            assert "killed by SIGKILL" in err["message"] and err["type"] == "server_error"
            assert s.events[-1] == "[DONE]"
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503
        assert health.json() == {"status": "engine_dead",
                                 "cause": "the engine core was killed by SIGKILL"}
        late = httpx.post(server.url + "/v1/completions",
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert late.status_code == 503
    finally:
        server.stop()


def test_the_front_end_exits_nonzero_when_its_core_dies(default_model_path):
    srv = ServeProcess()
    try:
        stream = _Stream(srv.url)
        stream.start()
        assert stream.first_token.wait(30)
        os.kill(_core_pid(srv.proc.pid), signal.SIGKILL)
        assert srv.proc.wait(15) == 1
        stream.join(10)
        assert any("killed by SIGKILL" in e for e in stream.events), stream.events[-3:]
        assert any("the engine core was killed by SIGKILL: exiting" in line
                   for line in srv.stderr)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_a_dead_front_end_makes_the_core_free_everything_and_exit(default_model_path):
    srv = ServeProcess()
    core = _core_pid(srv.proc.pid)
    streams = [_Stream(srv.url, p) for p in PROMPTS]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first_token.wait(30)
    srv.proc.kill()  # SIGKILL: no drain, no goodbye frame; the core sees EOF
    srv.proc.wait()
    _wait(lambda: not _alive(core), 60)  # a deadline on the wait: the core must exit
    _wait(lambda: any("engine core stopping" in line for line in srv.stderr), 30)
    line = next(line for line in srv.stderr if "engine core stopping" in line)
    assert "(front end gone): 0 sequences hold blocks" in line, line
    free, total = (int(x) for x in line.split("blocks,")[1].split("blocks free")[0]
                   .split(" of "))
    assert free == total > 0


@pytest.mark.slow  # builds engines of the default model
def test_grammars_prompt_logprobs_and_embeddings_cross_the_core_boundary(engine):
    """What the new per-request fields carry (a grammar, prompt logprobs, pooling) reaches a
    core in another process through the msgspec contract, with the in-process results."""
    from servelm.config import EngineArgs
    from servelm.core_process.client import CoreClient
    from servelm.loader import load_tokenizer, resolve_model

    requests = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A person?"}],
                                  "max_tokens": 40, "temperature": 0, "response_format": {
                                      "type": "json_schema", "json_schema": {"name": "p",
                                      "strict": True, "schema": {
                                          "type": "object",
                                          "properties": {"name": {"type": "string",
                                                                  "maxLength": 16}},
                                          "required": ["name"],
                                          "additionalProperties": False}}}}),
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2,
                             "temperature": 0, "echo": True, "logprobs": 1,
                             "logit_bias": {"7042": -100}}),
        ("/v1/embeddings", {"input": ["hello there"]}),
    ]

    def run(url):
        out = []
        for route, body in requests:
            r = httpx.post(url + route, json={"model": MODEL, **body}, timeout=60)
            assert r.status_code == 200, r.text
            j = r.json()
            out.append(j["data"][0]["embedding"] if route == "/v1/embeddings" else
                       j["choices"][0])
        return out

    client = CoreClient.spawn(EngineArgs(model=MODEL, kv_cache_memory=64 * 2**20,
                                         dtype="float32"),  # the local engine's dtype
                              load_tokenizer(resolve_model(MODEL)))
    remote = LiveServer(client)
    local = LiveServer(engine)
    try:
        got, want = run(remote.url), run(local.url)
    finally:
        remote.stop()
        local.stop()
    assert got[0]["message"] == want[0]["message"]
    assert got[0]["finish_reason"] == "stop", got[0]
    assert json.loads(got[0]["message"]["content"])["name"]
    assert got[1]["text"] == want[1]["text"] and " Paris" not in got[1]["text"]
    assert got[1]["logprobs"]["tokens"] == want[1]["logprobs"]["tokens"]
    assert got[1]["logprobs"]["token_logprobs"][0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(got[2], want[2]))
