"""Servers for the observability tests: an ASGI app served by uvicorn in a thread of the test
process, and model-free servelm engines (tests/fake_runner.py: the real scheduler, block
manager and prefix cache; a fake model with a chosen step time)."""

from __future__ import annotations

import socket
import threading
import time

import httpx


class Uvicorn:
    def __init__(self, app, sndbuf: int | None = None):
        import uvicorn

        sock = socket.socket()
        if sndbuf is not None:  # accepted connections inherit it (Linux)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def fake_server(*, step_s: float = 0.002, num_blocks: int = 512, block_size: int = 4,
                max_num_batched_tokens: int = 256, max_num_seqs: int = 32,
                max_model_len: int = 4096, prefix_caching: bool = False, sndbuf=None,
                **config) -> Uvicorn:
    from fake_runner import FakeRunner, make_engine

    from servelm.server.app import ServerConfig, build_app

    engine = make_engine(num_blocks=num_blocks, block_size=block_size,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         prefix_caching=prefix_caching,
                         runner=FakeRunner(step_s=step_s, block_size=block_size))
    config.setdefault("served_model_name", "fake")
    return Uvicorn(build_app(engine, ServerConfig(**config)), sndbuf=sndbuf)


def metrics(url: str, headers=None) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
