"""Servers for the observability tests: an ASGI app served by uvicorn in a thread of the test
process, and model-free servelm engines (tests/fake_runner.py: the real scheduler, block
manager and prefix cache; a fake model with a chosen step time)."""

from __future__ import annotations

import socket
import threading
import time

import httpx


class Uvicorn:
    """`write_buffer_high`: the transport's high-water mark in bytes (asyncio's default is
    64 KiB), so that a reader slower than the stream makes the server's writes wait sooner, as
    over a slow network."""

    def __init__(self, app, sndbuf: int | None = None, write_buffer_high: int | None = None):
        import uvicorn

        sock = socket.socket()
        if sndbuf is not None:  # accepted connections inherit it (Linux)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        options = {}
        state = getattr(app.state, "servelm", None)
        if state is not None:
            from servelm.server.draining_server import uvicorn_options

            options = uvicorn_options(state)
            if write_buffer_high is not None:
                base = options["http"]

                class SmallBuffer(base):
                    def connection_made(self, transport):
                        transport.set_write_buffer_limits(high=write_buffer_high)
                        super().connection_made(transport)

                options["http"] = SmallBuffer
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    **options))
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


def costed_runner(step_s: float, per_token_s: float, block_size: int):
    """A FakeRunner whose step takes step_s + per_token_s x tokens computed: prefill costs in
    proportion to its chunk, as on a compute-bound device."""
    from fake_runner import FakeRunner

    class CostedRunner(FakeRunner):
        def execute(self, step):
            time.sleep(step_s + per_token_s * step.num_batched_tokens)
            return super().execute(step)

    return CostedRunner(block_size=block_size)


def word_tokenizer(vocab_size: int = 1000, stall_word: str | None = None,
                   stall_s: float = 0.0):
    """Words w0 .. w{vocab_size-1}, one token each; a prompt containing `stall_word` takes
    `stall_s` to tokenize (an injected host stall, on the event loop like any short prompt)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from servelm.loader.tokenizer import Tokenizer

    vocab = {f"w{i}": i for i in range(vocab_size)}
    if stall_word is not None:
        vocab[stall_word] = vocab_size - 1
    backend = Backend(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    class StallingTokenizer(Tokenizer):
        def encode(self, text, add_special_tokens=True):
            if stall_word is not None and stall_word in text:
                time.sleep(stall_s)
            return super().encode(text, add_special_tokens)

    return StallingTokenizer(backend, bos_token_id=None, eos_token_ids=(1,))


def fake_server(*, step_s: float = 0.002, per_token_s: float = 0.0, num_blocks: int = 512,
                block_size: int = 4, max_num_batched_tokens: int = 256, max_num_seqs: int = 32,
                max_model_len: int = 4096, prefix_caching: bool = False, sndbuf=None,
                write_buffer_high=None, tokenizer=None, setup=None, **config) -> Uvicorn:
    """`setup(app)` runs on the built app before it serves (e.g. to install tracing)."""
    from servelm.config import SchedulerConfig
    from servelm.engine.block_manager import BlockManager
    from servelm.engine.engine import Engine
    from servelm.server.app import ServerConfig, build_app

    # A tokenizer makes the stream carry text, so each token is written as it comes.
    engine = Engine(costed_runner(step_s, per_token_s, block_size), tokenizer or word_tokenizer(),
                    BlockManager(num_blocks, block_size, prefix_caching),
                    SchedulerConfig(max_num_batched_tokens, max_num_seqs, True),
                    max_model_len, 1000, (1,))
    config.setdefault("served_model_name", "fake")
    app = build_app(engine, ServerConfig(**config))
    if setup is not None:
        setup(app)
    return Uvicorn(app, sndbuf=sndbuf, write_buffer_high=write_buffer_high)


def metrics(url: str, headers=None) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
