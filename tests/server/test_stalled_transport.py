"""The slow-reader defences through the real server, with a transport stalled on purpose (its
protocol told to pause writing, as a full socket buffer would) instead of megabytes of
unread output: while a reader is stalled its deltas merge (one pending delta per choice, so
the next write carries everything since), and a reader stalled past --write-timeout is
dropped and its request aborted."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from live_server import MODEL, LiveServer

WRITE_TIMEOUT = 4.0


class Transports:
    """The server side of each accepted connection, by the client's port."""

    def __init__(self):
        self.by_port: dict[int, object] = {}
        self.lock = threading.Lock()

    def wrap(self, base):
        registry = self

        class Recording(base):
            def connection_made(self, transport):
                super().connection_made(transport)
                if self.client is not None:
                    with registry.lock:
                        registry.by_port[self.client[1]] = self

        return Recording

    def _call(self, port: int, method: str) -> None:
        proto = self.by_port[port]
        proto.loop.call_soon_threadsafe(getattr(proto, method))

    def stall(self, port: int) -> None:
        self._call(port, "pause_writing")  # uvicorn's send now waits for the drain

    def resume(self, port: int) -> None:
        self._call(port, "resume_writing")


@pytest.fixture(scope="module")
def transports():
    return Transports()


@pytest.fixture(scope="module")
def server(engine, transports):
    s = LiveServer(engine, write_timeout=WRITE_TIMEOUT, wrap_protocol=transports.wrap)
    yield s
    s.stop()


def _open_stream(server, **body) -> socket.socket:
    payload = json.dumps({"model": MODEL, "prompt": "Tell me a story about a dragon.",
                          "temperature": 0, "ignore_eos": True, "stream": True,
                          **body}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


def _read_until(sock: socket.socket, marker: bytes, data: bytes = b"") -> bytes:
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _events(raw: bytes) -> list:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def _metric(server, name: str) -> float:
    return server.metrics()[name]


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_stalled_reader_gets_its_deltas_merged(server, transports):
    with server.client() as c:
        expected = c.post("/v1/completions", json={
            "model": MODEL, "prompt": "Tell me a story about a dragon.", "temperature": 0,
            "ignore_eos": True, "max_tokens": 60}).json()["choices"][0]["text"]
    generated = "servelm_generation_tokens_total"
    sock = _open_stream(server, max_tokens=60, logprobs=0)
    try:
        port = sock.getsockname()[1]
        head = _read_until(sock, b"data: ")  # the first delta has been written
        transports.stall(port)
        at_stall = _metric(server, generated)
        # the engine runs on while nothing can be written (shorter than the write timeout)
        deadline = time.monotonic() + WRITE_TIMEOUT / 2
        while _metric(server, generated) < at_stall + 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        num_while_stalled = _metric(server, generated) - at_stall
        transports.resume(port)
        raw = _read_until(sock, b"data: [DONE]", head)
    finally:
        sock.close()
    events = _events(raw)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert "".join(c["text"] for c in chunks) == expected
    sizes = [len(c["logprobs"]["tokens"]) for c in chunks if c["logprobs"]]
    assert sum(sizes) == 60
    assert num_while_stalled >= 4
    # what was generated while stalled came as one merged delta, not one event per token
    assert max(sizes) >= num_while_stalled - 2, (num_while_stalled, sizes)


def test_a_reader_stalled_past_the_write_timeout_is_dropped(server, transports):
    aborted = 'servelm_requests_finished_total{finish_reason="abort"}'
    before = _metric(server, aborted)
    sock = _open_stream(server, max_tokens=2000)
    try:
        _read_until(sock, b"data: ")
        transports.stall(sock.getsockname()[1])
        # aborted, not finished: the write timeout dropped it long before its 2000 tokens
        # (a deadline on the wait only, generous for a loaded machine)
        _wait(lambda: _metric(server, aborted) == before + 1, timeout=WRITE_TIMEOUT + 60)
        m = server.wait_idle()
        assert m["servelm_kv_blocks_free"] == m["servelm_kv_blocks_total"]
    finally:
        sock.close()
    with server.client() as c:  # and the server is fine
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
