"""Connection limits over raw sockets: a request's headers must arrive within
--header-timeout, an idle keep-alive connection closes after --keep-alive-timeout, and a
connection beyond --max-connections is answered 503 and closed, so half-open connections
cannot pile up until file descriptors run out."""

from __future__ import annotations

import selectors
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


WAIT_S = 60  # how long a test waits for the server to close a connection: a deadline on a
# wait, far beyond every timeout here, so that only a connection left open fails it


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(WAIT_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def _close_times(socks: list[socket.socket]) -> list[tuple[bytes, float]]:
    """Read all of `socks` at once until the server closes each: (data, seconds from now to
    its close) per socket, so that closes timed by the server can be compared."""
    start = time.monotonic()
    out: list[list] = [[b"", None] for _ in socks]
    with selectors.DefaultSelector() as sel:
        for i, sock in enumerate(socks):
            sel.register(sock, selectors.EVENT_READ, i)
        while any(seconds is None for _, seconds in out):
            ready = sel.select(WAIT_S)
            assert ready, "the server left a connection open"
            for key, _ in ready:
                chunk = key.fileobj.recv(65536)
                if chunk:
                    out[key.data][0] += chunk
                else:
                    out[key.data][1] = time.monotonic() - start
                    sel.unregister(key.fileobj)
    return [(data, seconds) for data, seconds in out]


def _count(server, reason: str) -> float:
    return server.metrics()[f'servelm_requests_rejected_total{{reason="{reason}"}}']


def test_half_a_request_line_is_closed_after_the_header_timeout(server):
    before = _count(server, "header_timeout")
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/compl")
        data = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b'"code": "header_timeout"' in data
    # the configured deadline closed it, not the default one (10 s)
    assert f"within {HEADER_TIMEOUT:g}s".encode() in data
    assert _count(server, "header_timeout") == before + 1


def test_a_connection_that_sends_nothing_is_closed(server):
    with _connect(server) as sock:
        data = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert f"within {HEADER_TIMEOUT:g}s".encode() in data


def test_trickled_headers_do_not_reset_the_deadline(server):
    """A header byte every 0.1 s, a tenth of the deadline: a deadline that each byte reset
    would never expire, so the connection's 408 shows that it was not reset."""
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        closed, data = False, b""
        deadline = time.monotonic() + WAIT_S
        while not closed and time.monotonic() < deadline:
            try:
                sock.sendall(b"X")
            except OSError:  # the server has closed it and reset our late byte
                closed = True
                break
            time.sleep(0.1)
            sock.setblocking(False)
            try:
                data, closed = sock.recv(65536), True
            except BlockingIOError:
                pass
            except OSError:
                closed = True
            finally:
                sock.setblocking(True)
        assert closed, "trickled headers kept the connection open"
        assert not data or data.startswith(b"HTTP/1.1 408 "), data


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
    """An idle kept-alive connection closes after --keep-alive-timeout (1 s here), not after
    uvicorn's default (5 s): timed against a silent connection opened with it, which the
    header deadline (also 1 s) closes, so a loaded machine delays both alike."""
    with _connect(server) as idle, _connect(server) as silent:
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        (data, idle_s), (silent_data, silent_s) = _close_times([idle, silent])
    assert data.startswith(b"HTTP/1.1 200 ")
    assert b"408" not in data  # closed quietly: idle between requests is keep-alive's
    assert silent_data.startswith(b"HTTP/1.1 408 ")
    assert idle_s < 2.5 * silent_s, (idle_s, silent_s)


def test_connections_beyond_the_cap_get_503_and_are_closed(server):
    before = _count(server, "too_many_connections")
    held = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)
        with _connect(server) as extra:
            data = _read_until_closed(extra)
        # answered at connect, not left to the header deadline (that would be a 408)
        assert data.startswith(b"HTTP/1.1 503 "), data
        assert b"too_many_connections" in data
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert _count(server, "too_many_connections") == before + 1
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200
