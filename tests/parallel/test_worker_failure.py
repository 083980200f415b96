"""A replica whose worker dies: every request fails with an error (no hang), the front end
says unhealthy, and no process of the replica survives; and the other way round, a worker
whose rank 0 dies exits by itself."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest
from parallel_helpers import save_tiny

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from live_server import MODEL, LiveServer
from test_engine_core_process import _alive, _children, _wait


def _workers(core_pid: int) -> list[int]:
    return [c for c in _children(core_pid)
            if b"servelm.core_process.worker" in Path(f"/proc/{c}/cmdline").read_bytes()]


class _Stream(threading.Thread):
    def __init__(self, url: str, prompt: str):
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.events: list[str] = []
        self.first_token = threading.Event()

    def run(self):
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if '"text"' in line:
                            self.first_token.set()
        except httpx.HTTPError as exc:
            self.events.append(f"transport error: {exc!r}")
        self.first_token.set()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("failure-models"),
                     max_position_embeddings=4096)


def _spawn(path: str):
    from servelm.config import EngineArgs
    from servelm.core_process.client import CoreClient
    from servelm.loader import load_tokenizer, resolve_model

    args = EngineArgs(model=path, tensor_parallel_size=2, num_blocks=512, block_size=4)
    return CoreClient.spawn(args, load_tokenizer(resolve_model(path)))


def test_a_killed_worker_fails_every_request_and_leaves_no_process(tiny_path):
    client = _spawn(tiny_path)
    server = LiveServer(client)
    core = client.proc.pid
    try:
        workers = _workers(core)
        assert len(workers) == 1 and _alive(workers[0])
        streams = [_Stream(server.url, " ".join(f"t{i + j}" for j in range(6)))
                   for i in range(3)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first_token.wait(60) and s.events, s.events
        assert httpx.get(server.url + "/health").status_code == 200
        os.kill(workers[0], signal.SIGKILL)  # mid-step: the streams are decoding
        for s in streams:
            s.join(20)
            assert not s.is_alive()
            errors = [json.loads(e)["error"] for e in s.events if '"error"' in e]
            assert errors and errors[0]["type"] == "server_error", s.events[-3:]
            assert s.events[-1] == "[DONE]"
        _wait(lambda: httpx.get(server.url + "/health").status_code == 503, 10)
        late = httpx.post(server.url + "/v1/completions",
                          json={"model": MODEL, "prompt": "t1", "max_tokens": 2})
        assert late.status_code == 503
        assert "worker rank 1" in httpx.get(server.url + "/health").text + \
            json.dumps(errors[0])
        _wait(lambda: not _alive(core), 15)  # the core exits: no orphan of the replica
        assert not _alive(workers[0])
    finally:
        server.stop()


@pytest.mark.slow  # a second replica start
def test_a_worker_exits_when_rank_0_dies(tiny_path):
    client = _spawn(tiny_path)
    core = client.proc.pid
    workers = _workers(core)
    assert len(workers) == 1
    os.kill(core, signal.SIGKILL)
    _wait(lambda: not _alive(workers[0]), 10)
    client.proc.wait(5)


@pytest.mark.slow  # a replica start of its own
def test_a_worker_killed_while_idle_turns_health_503_without_a_request(tiny_path):
    client = _spawn(tiny_path)
    server = LiveServer(client)
    core = client.proc.pid
    try:
        workers = _workers(core)
        assert httpx.get(server.url + "/health").status_code == 200
        os.kill(workers[0], signal.SIGKILL)
        _wait(lambda: httpx.get(server.url + "/health").status_code == 503, 5)
        assert "worker rank 1" in httpx.get(server.url + "/health").text
        _wait(lambda: not _alive(core), 15)
    finally:
        server.stop()
