"""Connection limits over raw sockets: a request's headers must arrive within
--header-timeout, an idle keep-alive connection closes after --keep-alive-timeout, and a
connection beyond --max-connections is answered 503 and closed, so half-open connections
cannot pile up until file descriptors run out."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from live_server import MODEL, LiveServer

HEADER_TIMEOUT = 1.0
MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def server(engine):
    s = LiveServer(engine, header_timeout=HEADER_TIMEOUT, keep_alive_timeout=1.0,
                   max_connections=MAX_CONNECTIONS)
    yield s
    s.stop()


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(10)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes; (data, seconds it took)."""
    start, data = time.monotonic(), b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def _count(server, reason: str) -> float:
    return server.metrics()[f'servelm_requests_rejected_total{{reason="{reason}"}}']


def test_half_a_request_line_is_closed_after_the_header_timeout(server):
    before = _count(server, "header_timeout")
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/compl")
        data, waited = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b'"code": "header_timeout"' in data
    assert waited < HEADER_TIMEOUT + 3
    assert _count(server, "header_timeout") == before + 1


def test_a_connection_that_sends_nothing_is_closed(server):
    with _connect(server) as sock:
        data, waited = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert waited < HEADER_TIMEOUT + 3


def test_trickled_headers_do_not_reset_the_deadline(server):
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        closed = False
        for _ in range(40):  # a header byte every 0.1 s: never complete in time
            try:
                sock.sendall(b"X")
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            sock.setblocking(False)
            try:
                if sock.recv(65536) is not None:
                    closed = True
                    break
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
        assert closed, "trickled headers kept the connection open"
        assert time.monotonic() - start < HEADER_TIMEOUT + 3


def test_headers_in_time_are_served_and_a_body_may_follow(server):
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        time.sleep(HEADER_TIMEOUT + 0.5)  # the header deadline does not cover the body
        sock.sendall(body)
        data = sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 200 "), data


def test_an_idle_keep_alive_connection_is_closed(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, waited = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200 ")
    assert b"408" not in data  # closed quietly: idle between requests is keep-alive's
    assert waited < 1.0 + 3


def test_connections_beyond_the_cap_get_503_and_are_closed(server):
    before = _count(server, "too_many_connections")
    held = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)
        with _connect(server) as extra:
            data, waited = _read_until_closed(extra)
        assert data.startswith(b"HTTP/1.1 503 "), data
        assert b"too_many_connections" in data and waited < 1.0
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert _count(server, "too_many_connections") == before + 1
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200
