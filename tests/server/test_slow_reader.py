"""A stream reader that stops reading is dropped after --write-timeout, over a real socket.

Small socket buffers on both ends make the server's writes block after a few tens of KB
(uvicorn then awaits the transport's drain); echo of a long prompt with n=8 writes far more
than that before the first token, so the stall happens at once.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from live_server import MODEL, LiveServer


@pytest.fixture(scope="module")
def server(engine):
    s = LiveServer(engine, sndbuf=4096, write_timeout=1.0)
    yield s
    s.stop()


def test_stalled_reader_is_dropped_and_its_request_aborted(server):
    aborted = 'servelm_requests_finished_total{finish_reason="abort"}'
    before = server.metrics()[aborted]
    body = json.dumps({"model": MODEL, "prompt": "=" * 24000, "n": 8, "echo": True,
                       "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", server.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while server.metrics()[aborted] == before:  # never read: the server must give up
            assert time.monotonic() < deadline, "stalled reader was not dropped"
            time.sleep(0.1)
        m = server.wait_idle()
        assert m["servelm_kv_blocks_free"] == m["servelm_kv_blocks_total"]
        assert m['servelm_requests_finished_total{finish_reason="length"}'] == 0
    finally:
        sock.close()
    with server.client() as c:  # and the server is fine
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
