"""CoreClient: the front end's side of an engine core process.

Owns: starting the core (`python -m servelm.core_process.process`, a ProcessSpec the
launcher's Supervisor starts: servelm/launch/), the handshake (versions, the EngineArgs to
build, the CoreInfo back), and the same event-loop API as the in-process
AsyncEngine (submit / abort / release / generate, snapshot, is_alive), so the HTTP server
cannot tell them apart. Two threads keep the event loop off the socket:

    event loop                        front end threads                  core process
    submit/abort -> frame queue  -->  writer: sendall               -->  reader -> EngineLoop
    streams <- call_soon_threadsafe   reader: recv + decode frames  <--  writer <- EngineLoop

When the core dies (EOF on the socket), every in-flight request fails with an
EngineDeadError naming the cause (exit code or signal) and `on_dead` runs on the loop (the
server uses it to exit non-zero so that a supervisor restarts the pair).
Never: imports torch or runs engine code.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable

from servelm.core import codec
from servelm.core.codec import (Abort, AddRequest, Admitted, CodecError, CoreInfo, Fatal, Hello,
                                LoadLora, LoraResult, Outputs, Ready, Rejected, Shutdown, Start,
                                UnloadLora)
from servelm.core.contract import CONTRACT_VERSION, StepReport
from servelm.core_process.process import recv_frame
from servelm.engine.async_engine import EngineDeadError, RequestStream, StreamRouter
from servelm.launch import (INHERIT, Accepted, LaunchError, ProcessHandle, ProcessSpec,
                            Resources, Supervisor)
from servelm.protocol import EngineRequest, InvalidParameterError

logger = logging.getLogger(__name__)


class CoreStartError(RuntimeError):
    """The engine core could not be started (build failure, version mismatch, crash)."""


def core_spec(path: str, connected: Accepted, env: dict | None = None) -> ProcessSpec:
    """The engine core process: ready once it connects to `path`. Its stderr is the front
    end's own and it gets no parent-death signal: when the front end dies, the core sees
    the connection end, frees every block and says so in the log before it exits."""
    argv = (sys.executable, "-m", "servelm.core_process.process", "--connect", path)
    return ProcessSpec("the engine core", argv,
                       resources=Resources(env=env or {}), readiness=connected,
                       ready_timeout_s=60.0, stderr=INHERIT, parent_death_signal=None)


def _exit_cause(handle: ProcessHandle) -> str:
    death = handle.death(settle_s=1.0)
    if death is None:
        return "the engine core closed its connection (still running)"
    return f"the engine core {'was ' if death.exit_code is None else ''}{death.how}"


class CoreClient(StreamRouter):
    def __init__(self, handle: ProcessHandle, sock: socket.socket, info: CoreInfo,
                 tokenizer=None, on_dead: Callable[[str], None] | None = None):
        super().__init__()
        self.handle = handle
        self.proc = handle.proc
        self.sock = sock
        self.info = info
        self.tokenizer = tokenizer
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.model_name = info.model_name
        self.block_size = info.block_size
        self.lora_names = list(info.lora_names)
        self._lora_calls: dict[int, object] = {}  # call id -> its future (loop side)
        self._lora_call_ids = iter(range(1, 2**62))
        self.on_dead = on_dead  # called on the loop with the cause when the core dies
        self.snapshot = StepReport(num_total_blocks=info.num_blocks,
                                   num_free_blocks=info.num_blocks)
        self.observer: Callable | None = None  # observer(report, deltas), on the loop
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._num_queued_adds = 0  # sent, not yet admitted or rejected (loop side)
        self._dead_cause: str | None = None
        self._fatal: str | None = None
        self._stopping = False
        self.crashed = False  # the core died while serving (not a shutdown)
        self._threads: list[threading.Thread] = []

    # -- start-up --------------------------------------------------------------------------

    @classmethod
    def spawn(cls, engine_args, tokenizer=None, startup_timeout: float = 900.0,
              env: dict | None = None) -> CoreClient:
        """Start a core process for `engine_args` (`env`: added to this process's
        environment), wait until its engine is built."""
        tmp = tempfile.mkdtemp(prefix="servelm-core-")
        path = os.path.join(tmp, "core.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        supervisor, handle = Supervisor(stop_at_exit=False), None
        try:
            listener.bind(path)
            listener.listen(1)
            connected = Accepted(listener, what="the engine core to connect")
            handle = supervisor.start(core_spec(path, connected, env), wait=False)
            try:
                supervisor.wait_ready([handle])
            except LaunchError as exc:
                raise CoreStartError(str(exc)) from None
            sock = connected.sock
            sock.sendall(codec.frame(Hello(CONTRACT_VERSION, "frontend", os.getpid())))
            sock.sendall(codec.frame(Start(engine_args)))
            info = cls._handshake(sock, handle, startup_timeout)
        except BaseException:
            if handle is not None and handle.is_alive:
                handle.signal(signal.SIGKILL)
                handle.proc.wait()
            raise
        finally:
            listener.close()
            shutil.rmtree(tmp, ignore_errors=True)
        return cls(handle, sock, info, tokenizer)

    @staticmethod
    def _handshake(sock: socket.socket, handle: ProcessHandle, timeout: float) -> CoreInfo:
        sock.settimeout(timeout)
        try:
            codec.check_hello(recv_frame(sock, codec.core_decoder), "core")
            msg = recv_frame(sock, codec.core_decoder)
        except TimeoutError:
            raise CoreStartError(f"the engine core was not ready within {timeout:g} s") \
                from None
        except CodecError as exc:
            raise CoreStartError(str(exc)) from exc
        finally:
            sock.settimeout(None)
        if isinstance(msg, Fatal):
            raise CoreStartError(msg.message)
        if not isinstance(msg, Ready):
            raise CoreStartError(f"the engine core sent no Ready ({_exit_cause(handle)})")
        return msg.info

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, loop=None) -> None:
        import asyncio

        self._loop = loop or asyncio.get_running_loop()
        for target, name in ((self._read, "servelm-core-client-reader"),
                             (self._write, "servelm-core-client-writer")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the core to abort everything and exit; kill it if it does not."""
        self._stopping = True
        self._out.put(codec.frame(Shutdown()))
        self._out.put(None)
        self.handle.is_stopping = True
        self.handle.wait_or_kill(timeout)
        try:
            self.sock.close()
        except OSError:
            pass

    @property
    def is_alive(self) -> bool:
        return (self._dead_cause is None and not self._stopping and self._loop is not None
                and self.proc.poll() is None)

    @property
    def dead_cause(self) -> str | None:
        return self._dead_cause

    @property
    def num_queued_adds(self) -> int:
        return self._num_queued_adds

    # -- commands (event loop) -------------------------------------------------------------

    def _send_add(self, requests: list[EngineRequest], stream: RequestStream) -> None:
        self._num_queued_adds += len(requests)
        for r in requests:
            self._out.put(codec.frame(AddRequest(r)))

    def _send_abort(self, request_id: str) -> None:
        self._out.put(codec.frame(Abort(request_id)))

    def _send_lora(self, op: str, name: str, path: str, done) -> None:
        call_id = next(self._lora_call_ids)
        self._lora_calls[call_id] = done
        msg = LoadLora(call_id, name, path) if op == "load" else UnloadLora(call_id, name)
        self._out.put(codec.frame(msg))

    # -- threads ---------------------------------------------------------------------------

    def _write(self) -> None:
        while True:
            data = self._out.get()
            if data is None:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                return  # the reader sees the connection end and fails what is in flight

    def _read(self) -> None:
        try:
            while True:
                msg = recv_frame(self.sock, codec.core_decoder)
                if msg is None:
                    break
                self._post(self._on_message, msg)
        except (OSError, CodecError) as exc:
            if not self._stopping:
                logger.error("engine core connection failed: %s", exc)
        cause = self._fatal or _exit_cause(self.handle)
        self._post(self._on_core_gone, cause)

    # -- on the loop -----------------------------------------------------------------------

    def _on_message(self, msg) -> None:
        if isinstance(msg, Outputs):
            if msg.kv_events:
                self.kv_events.extend(msg.kv_events)
            if msg.report is not None:
                self.snapshot = msg.report
                if self.observer is not None:
                    try:
                        self.observer(msg.report, msg.deltas)
                    except Exception:
                        logger.exception("step observer failed")
            if msg.deltas:
                self._dispatch(msg.deltas)
        elif isinstance(msg, Admitted):
            self.snapshot.num_waiting_requests = msg.num_waiting_requests
            self._num_queued_adds -= 1
            self._admitted(None, msg.request_id)
        elif isinstance(msg, Rejected):
            self._num_queued_adds -= 1
            self._rejected(None, msg.request_id,
                           InvalidParameterError(msg.message, msg.param, msg.code))
        elif isinstance(msg, LoraResult):
            done = self._lora_calls.pop(msg.call_id, None)
            exc = None if msg.message is None else InvalidParameterError(
                msg.message, msg.param, msg.code)
            if done is not None:
                self._lora_done(done, msg.lora_names, exc)
            else:
                self.lora_names = list(msg.lora_names)
        elif isinstance(msg, Fatal):
            self._fatal = msg.message
        else:
            logger.error("unexpected %s frame from the engine core", type(msg).__name__)

    def _on_core_gone(self, cause: str) -> None:
        self._dead_cause = cause
        self._num_queued_adds = 0
        calls, self._lora_calls = self._lora_calls, {}
        for done in calls.values():
            if not done.done():
                done.set_exception(EngineDeadError(cause))
        if self._stopping:
            self._fail_all(EngineDeadError("the engine was stopped"))
            return
        self.crashed = True
        logger.error("%s; failing every in-flight request", cause)
        self._fail_all(EngineDeadError(cause))
        if self.on_dead is not None:
            self.on_dead(cause)


__all__ = ["CoreClient", "CoreStartError"]
