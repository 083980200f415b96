"""LiveServer: build_app(engine, ...) served by uvicorn in a thread of the test process, on a
free port of 127.0.0.1 (import as `live_server`; the fixtures are in conftest.py)."""

from __future__ import annotations

import re
import socket
import tempfile
import threading
import time

import httpx

MODEL = "smollm2-135m-instruct"


class LiveServer:
    """build_app(engine, ServerConfig(**overrides)) served by uvicorn in a thread."""

    def __init__(self, engine, sndbuf: int | None = None, wrap_protocol=None, **overrides):
        """`wrap_protocol(cls) -> cls` may subclass the HTTP protocol (a test's transport
        hooks); `overrides` are ServerConfig fields."""
        import uvicorn

        from servelm.server.app import ServerConfig, build_app

        if "state_store" not in overrides:  # not the user's $SERVELM_HOME store (batches)
            self._home = tempfile.TemporaryDirectory(prefix="servelm-state-")
            overrides["state_store"] = f"sqlite:///{self._home.name}/state.sqlite3"
        self.config = ServerConfig(served_model_name=MODEL, **overrides)
        self.app = build_app(engine, self.config)
        self.state = self.app.state.servelm
        sock = socket.socket()
        if sndbuf is not None:  # accepted connections inherit it (Linux)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        from servelm.server.draining_server import uvicorn_options

        options = uvicorn_options(self.state)
        if wrap_protocol is not None:
            options["http"] = wrap_protocol(options["http"])
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    access_log=False, **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, **kwargs) -> httpx.Client:
        headers = kwargs.pop("headers", {})
        if self.config.api_key:
            headers.setdefault("Authorization", f"Bearer {self.config.api_key}")
        return httpx.Client(base_url=self.url, timeout=60, headers=headers, **kwargs)

    def metrics(self) -> dict[str, float]:
        with self.client() as c:
            return parse_metrics(c.get("/metrics").text)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Metrics once no request runs or waits and every KV block is free."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["servelm_kv_blocks_free"] == m["servelm_kv_blocks_total"]
                    and m["servelm_num_requests_running"] == 0
                    and m["servelm_num_requests_waiting"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out
