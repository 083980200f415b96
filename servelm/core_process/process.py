"""The engine core process: scheduler + runner behind a local socket.

Owns: the core's side of the front end <-> core connection (servelm/core/codec.py): the
handshake, building the engine from the EngineArgs the front end sends, and three threads
so that neither side can stall the other:

    reader thread   socket -> AddRequest / Abort / LoadLora / UnloadLora / Shutdown
                    -> EngineLoop commands
    main thread     EngineLoop.run(): apply commands, step, report  (never touches the socket)
    writer thread   queue of encoded frames -> socket (a slow front end backs up here only)

When the front end goes away (EOF, a reset, or a malformed frame), the core aborts every
request it holds, steps until no sequence holds a block, logs what it freed and exits.
Never: decodes anything but the codec's frontend messages, or outlives its front end.

Run as `python -m servelm.core_process.process --connect PATH` (the front end does this).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import socket
import sys
import threading

from servelm import startup
from servelm.core import codec
from servelm.core.codec import (Abort, AddRequest, Admitted, CodecError, CoreInfo, Fatal,
                                Hello, LoadLora, LoraResult, Outputs, Ready, Rejected, Shutdown,
                                Start, UnloadLora)
from servelm.core.contract import CONTRACT_VERSION

logger = logging.getLogger("servelm.core")


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None at a clean EOF before the first byte."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if not buf:
                return None
            raise CodecError(f"connection closed inside a frame ({len(buf)}/{n} bytes)")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, decoder: codec.Decoder):
    """One decoded message, or None at EOF."""
    header = recv_exactly(sock, codec.HEADER_BYTES)
    if header is None:
        return None
    body = recv_exactly(sock, codec.frame_length(header))
    if body is None:
        raise CodecError("connection closed after a frame header")
    return decoder.decode(body)


def describe_engine(engine) -> CoreInfo:
    args = engine.engine_args
    return CoreInfo(
        model_name=engine.model_name, model_config=engine.model_config,
        max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
        num_blocks=engine.block_manager.num_blocks, block_size=engine.block_manager.block_size,
        dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        device_type=args.device.split(":")[0], speculative=engine.speculator is not None,
        startup_stages=dict(startup.timer().stages), startup_notes=dict(startup.timer().notes),
        lora_names=engine.lora_names())


class _SocketSink:
    """EngineLoop outputs -> encoded frames on the writer's queue (never blocks the loop)."""

    def __init__(self, out: queue.SimpleQueue):
        self.out = out

    def admitted(self, request_id, token, num_waiting_requests) -> None:
        self.out.put(codec.frame(Admitted(request_id, num_waiting_requests)))

    def rejected(self, request_id, token, exc) -> None:
        self.out.put(codec.frame(Rejected(request_id, str(exc), exc.param, exc.code)))

    def outputs(self, deltas, report, kv_events) -> None:
        self.out.put(codec.frame(Outputs(deltas, report, kv_events)))

    def dead(self, exc) -> None:
        self.out.put(codec.frame(Fatal(f"engine loop crashed: {exc!r}")))

    def lora_done(self, call_id, names, exc) -> None:
        if exc is None:
            self.out.put(codec.frame(LoraResult(call_id, names)))
        else:
            self.out.put(codec.frame(LoraResult(call_id, names, str(exc),
                                                getattr(exc, "param", None),
                                                getattr(exc, "code", None))))

    def stopped(self) -> None:
        pass


class EngineCore:
    """One engine behind one connected socket."""

    def __init__(self, engine, sock: socket.socket):
        from servelm.engine.engine_loop import EngineLoop

        self.engine = engine
        self.sock = sock
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.loop = EngineLoop(engine, _SocketSink(self.out))
        self.front_end_gone = False
        self.failed: str | None = None  # set by fail()

    def run(self) -> int:
        reader = threading.Thread(target=self._read, name="servelm-core-reader", daemon=True)
        writer = threading.Thread(target=self._write, name="servelm-core-writer", daemon=True)
        writer.start()
        reader.start()
        self.loop.run()  # returns after stop() (front end gone or Shutdown) or a crash
        crashed = self.loop.dead_error is not None or self.failed is not None
        bm = self.engine.block_manager
        live = self.engine.scheduler.live_sequences()
        logger.warning("engine core stopping (%s): %d sequences hold blocks, %d of %d blocks "
                       "free", "crash" if crashed else
                       ("front end gone" if self.front_end_gone else "shutdown"),
                       len(live), bm.num_free_blocks, bm.num_blocks)
        self.out.put(None)  # the writer flushes what is queued, then ends
        writer.join(5.0)
        return 1 if crashed else 0

    def fail(self, cause: str) -> None:
        """The engine broke outside a step (a model-parallel worker died while idle): tell
        the front end why, then stop (any thread)."""
        self.failed = cause
        self.out.put(codec.frame(Fatal(cause)))
        self.loop.stop()

    def _read(self) -> None:
        try:
            while True:
                msg = recv_frame(self.sock, codec.frontend_decoder)
                if msg is None:
                    break
                if isinstance(msg, AddRequest):
                    self.loop.add([msg.request])
                elif isinstance(msg, Abort):
                    self.loop.abort(msg.request_id)
                elif isinstance(msg, LoadLora):
                    self.loop.lora("load", msg.lora_name, msg.lora_path, msg.call_id)
                elif isinstance(msg, UnloadLora):
                    self.loop.lora("unload", msg.lora_name, "", msg.call_id)
                elif isinstance(msg, Shutdown):
                    self.loop.stop()
                    return
                else:
                    raise CodecError(f"unexpected {type(msg).__name__} frame")
        except (OSError, CodecError) as exc:
            logger.error("front end connection failed: %s", exc)
        self.front_end_gone = True
        self.loop.stop()

    def _write(self) -> None:
        while True:
            data = self.out.get()
            if data is None:
                return
            try:
                self.sock.sendall(data)
            except OSError:  # the front end is gone; the reader sees it too
                self.front_end_gone = True
                self.loop.stop()
                return


def serve(path: str) -> int:
    """Connect to the front end at `path`, handshake, build the engine, run it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(codec.frame(Hello(CONTRACT_VERSION, "core", os.getpid())))
    try:
        codec.check_hello(recv_frame(sock, codec.frontend_decoder), "frontend")
        start = recv_frame(sock, codec.frontend_decoder)
        if not isinstance(start, Start):
            raise CodecError(f"expected a Start frame, got {type(start).__name__}")
    except CodecError as exc:
        logger.error("%s", exc)
        sock.sendall(codec.frame(Fatal(str(exc))))
        return 2
    try:
        from servelm.engine_builder import build_engine

        engine = build_engine(start.engine_args)
    except Exception as exc:  # the front end reports it and exits
        logger.exception("engine build failed")
        sock.sendall(codec.frame(Fatal(f"engine build failed: {exc}")))
        return 1
    sock.sendall(codec.frame(Ready(describe_engine(engine))))
    core = EngineCore(engine, sock)
    watch = getattr(engine.runner, "watch_workers", None)
    if watch is not None:  # model-parallel (servelm/parallel/runner.py): fail at a death
        watch(core.fail)
    return core.run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servelm.core_process.process",
                                description="servelm engine core (started by a front end)")
    p.add_argument("--connect", required=True, help="the front end's unix socket path")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[servelm core %(process)d] %(message)s")
    return serve(args.connect)


if __name__ == "__main__":
    sys.exit(main())
