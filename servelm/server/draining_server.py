"""DrainingServer: a uvicorn.Server whose first SIGTERM/SIGINT drains instead of exiting.

Owns: the shutdown order. uvicorn alone closes its listening sockets on SIGTERM, so new
clients would see a refused connection; here the sockets stay open and new requests get a
503 (health too, so a load balancer stops sending), in-flight requests run for up to
`drain_timeout` seconds, then uvicorn shuts down and the app's lifespan aborts whatever is
left. A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import uvicorn


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, drain_timeout: float,
                 ready_message: str = ""):
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
            print(self.ready_message, file=sys.stderr, flush=True)

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
