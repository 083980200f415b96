"""DrainingServer: a uvicorn.Server whose first SIGTERM/SIGINT drains instead of exiting.

Owns: the shutdown order. uvicorn alone closes its listening sockets on SIGTERM, so new
clients would see a refused connection; here the sockets stay open and new requests get a
503 (health too, so a load balancer stops sending), in-flight requests run for up to
`drain_timeout` seconds, then uvicorn shuts down and the app's lifespan aborts whatever is
left. A second SIGINT exits at once.

Also owns the connection limits uvicorn lacks (`uvicorn_options`): uvicorn closes a
keep-alive connection that stays idle after a response, but arms no timer on a new
connection, nor on one that has sent part of a request, so a client holding half-open
connections could exhaust file descriptors. `GuardedH11Protocol` gives every request a
deadline for its request line and headers (`header_timeout`, answered 408 and closed) and
answers a connection beyond `max_connections` with a 503 and closes it at once.

    connect ──┬── request line + headers within header_timeout ── app ── response ──┐
              │                                                                      │
              └── too slow: 408, close          idle keep_alive_timeout: close ──────┤
                              next request's first byte: header timer again ◄────────┘
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap. The limits and
    the metrics come from the subclass `uvicorn_options` makes (uvicorn builds a protocol per
    connection from its Config alone)."""

    header_timeout: float = 10.0
    max_connections: int = 1024
    metrics: Any = None  # ServerMetrics

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._count("too_many_connections")
            transport.write(_raw_response(
                503, "Service Unavailable", f"too many open connections "
                f"({self.max_connections}); retry later", "too_many_connections"))
            transport.close()
            return
        self._set_connections_gauge()
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._cancel_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            # Part of the next request on a kept-alive connection (uvicorn has just cancelled
            # its keep-alive timer): from its first byte it gets the same deadline.
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)
        self._set_connections_gauge()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        timer = self._header_timer
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._count("header_timeout")
        self.transport.write(_raw_response(
            408, "Request Timeout", f"request line and headers did not arrive within "
            f"{self.header_timeout:g}s", "header_timeout"))
        self.transport.close()

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()

    def _set_connections_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.connections.set(len(self.connections))


def uvicorn_options(state) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for the connection limits of `state.config`
    (a ServerState: its config's timeouts and cap, its metrics)."""
    config = state.config
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout": config.header_timeout, "max_connections": config.max_connections,
        "metrics": state.metrics})
    return {"http": protocol, "timeout_keep_alive": config.keep_alive_timeout}


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, drain_timeout: float,
                 ready_message=""):
        super().__init__(config)
        self.state = state  # ServerState
        self.drain_timeout = drain_timeout
        self.ready_message = ready_message
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.ready_message:
            message = self.ready_message  # a string, or a callable made when listening
            print(message() if callable(message) else message, file=sys.stderr, flush=True)

    def handle_exit(self, sig, frame) -> None:
        # Runs in the main thread's signal handler: only schedule work on the loop.
        if self._draining or self._loop is None:
            if sig == signal.SIGINT and self._draining:
                self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        state = self.state
        print(f"[servelm] draining: up to {self.drain_timeout:g}s for {state.num_inflight} "
              f"in-flight request(s)", file=sys.stderr, flush=True)
        if not await state.drain(self.drain_timeout):
            print(f"[servelm] drain timeout: aborting {state.num_inflight} request(s)",
                  file=sys.stderr, flush=True)
        self.should_exit = True
