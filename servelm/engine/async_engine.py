"""AsyncEngine: an Engine driven by its own thread, consumed from an asyncio event loop.

Owns: the engine thread (the only thread that ever calls Engine.add_request / abort / step),
the command queue into it, and per-request `RequestStream`s on the event loop that the thread
feeds with loop.call_soon_threadsafe. Never: waits on a client (delivery is fire-and-forget
into the loop), or runs engine code on the event loop.

    event loop                         engine thread
    ----------                         -------------
    submit(req) --cmd queue+cond-->    engine.add_request(req)   (error -> stream.fail)
    abort(rid)  --cmd queue+cond-->    engine.abort(rid)
    stream.put(delta) <--call_soon_threadsafe(dispatch, deltas)-- engine.step()

A RequestStream coalesces: it holds at most one pending (merged) delta per choice, so a slow
reader makes chunks bigger, never a queue longer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from servelm.protocol import EngineRequest, FinishReason, InvalidParameterError, TokenDelta

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); in-flight requests fail with it."""


def merge_delta(into: TokenDelta, delta: TokenDelta) -> None:
    """Fold a later delta of the same choice into an earlier, not yet delivered one."""
    into.text += delta.text
    into.token_ids = into.token_ids + delta.token_ids
    if delta.logprobs is not None:
        into.logprobs = (into.logprobs or []) + delta.logprobs
    into.finish_reason = delta.finish_reason or into.finish_reason
    into.num_prompt_tokens = delta.num_prompt_tokens or into.num_prompt_tokens
    into.num_output_tokens = delta.num_output_tokens
    into.timings = delta.timings or into.timings
    into.error = delta.error or into.error


class RequestStream:
    """Loop-side buffer for one or more engine requests (one HTTP request may hold several
    prompts). Keyed by (request_id, index); lives and is touched only on the event loop."""

    def __init__(self, request_ids: list[str]):
        self.request_ids = list(request_ids)
        self._pending: dict[tuple[str, int], TokenDelta] = {}
        self._event = asyncio.Event()
        self._unfinished = set(request_ids)
        self._unadmitted = set(request_ids)
        self.admitted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.error: BaseException | None = None
        self.first_delta_time: float | None = None

    @property
    def is_finished(self) -> bool:
        return not self._unfinished or self.error is not None

    # -- called by the dispatcher (on the loop) --------------------------------------------

    def _on_admitted(self, request_id: str) -> None:
        self._unadmitted.discard(request_id)
        if not self._unadmitted and not self.admitted.done():
            self.admitted.set_result(True)

    def put(self, delta: TokenDelta) -> None:
        if self.first_delta_time is None:
            self.first_delta_time = time.monotonic()
        key = (delta.request_id, delta.index)
        pending = self._pending.get(key)
        if pending is None:
            self._pending[key] = delta
        else:
            merge_delta(pending, delta)
        if delta.timings is not None:  # the request's last delta
            self._unfinished.discard(delta.request_id)
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if not self.admitted.done():
            self.admitted.set_exception(exc)
            self.admitted.exception()  # mark retrieved: a waiter may be gone
        self._event.set()

    # -- called by the consumer ------------------------------------------------------------

    async def get(self) -> list[TokenDelta]:
        """Everything pending (merged per choice), waiting until there is something. Raises
        the stream's error once pending deltas are drained; [] when finished."""
        while not self._pending:
            if self.error is not None:
                raise self.error
            if not self._unfinished:
                return []
            self._event.clear()
            await self._event.wait()
        out = list(self._pending.values())
        self._pending.clear()
        return out

    @property
    def num_pending_tokens(self) -> int:
        return sum(len(d.token_ids) for d in self._pending.values())


@dataclass
class _Command:
    kind: str  # "add" | "abort"
    request: EngineRequest | None = None
    request_id: str = ""
    stream: RequestStream | None = None
    loop: asyncio.AbstractEventLoop | None = None


@dataclass
class EngineSnapshot:
    """What the event loop may read about the engine, published by the engine thread."""

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_used_blocks: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_steps: int = 0
    updated: float = field(default_factory=time.monotonic)


class AsyncEngine:
    """Runs `engine` on a dedicated thread. `observer(engine, deltas, step_s)` is called on
    the engine thread after each step (metrics; step_s is None when no model step ran, e.g.
    only abort deltas came out); it must be cheap and must not block."""

    def __init__(self, engine, observer: Callable | None = None):
        self.engine = engine
        self.observer = observer
        self._cond = threading.Condition()
        self._commands: list[_Command] = []
        self._num_queued_adds = 0
        self._streams: dict[str, RequestStream] = {}  # loop side
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead_error: BaseException | None = None
        self._live_ids: set[str] = set()  # engine thread only: admitted, not finished
        self.snapshot = EngineSnapshot(num_total_blocks=engine.block_manager.num_blocks,
                                       num_free_blocks=engine.block_manager.num_free_blocks)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="servelm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort everything in flight and join the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self._dead_error is None)

    @property
    def num_queued_adds(self) -> int:
        return self._num_queued_adds

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not yet scheduled (incl. those still crossing to the thread)."""
        return self._num_queued_adds + self.snapshot.num_waiting_requests

    # -- event-loop API --------------------------------------------------------------------

    def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue requests for the engine thread; their deltas go to one RequestStream.
        `await stream.admitted` raises InvalidParameterError if the engine rejects one."""
        stream = RequestStream([r.request_id for r in requests])
        if not self.is_alive:
            stream.fail(EngineDeadError("the engine is not running"))
            return stream
        loop = asyncio.get_running_loop()
        for r in requests:
            self._streams[r.request_id] = stream
        with self._cond:
            for r in requests:
                self._commands.append(_Command("add", request=r, stream=stream, loop=loop))
                self._num_queued_adds += 1
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe. The request's last delta (finish_reason abort) comes with the next
        step; its blocks are freed as soon as the engine thread takes the command."""
        with self._cond:
            self._commands.append(_Command("abort", request_id=request_id))
            self._cond.notify()

    def abort_all(self) -> int:
        """Abort every request a consumer still waits on (event loop only). Returns how many."""
        rids = list(self._streams)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def release(self, stream: RequestStream) -> None:
        """The consumer is gone: abort what is unfinished, stop routing deltas to it."""
        for rid in stream.request_ids:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
                if rid in stream._unfinished:
                    self.abort(rid)

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        """Deltas of one request, merged per choice when the consumer is slower than the
        engine. Raises InvalidParameterError if the engine rejects it. Closing the iterator
        early aborts the request."""
        stream = self.submit([request])
        try:
            await stream.admitted
            while True:
                deltas = await stream.get()
                if not deltas:
                    return
                for d in deltas:
                    yield d
        finally:
            self.release(stream)

    # -- dispatch (runs on the loop) -------------------------------------------------------

    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None:
                continue
            stream.put(d)
            if d.timings is not None:
                self._streams.pop(d.request_id, None)

    def _admitted(self, stream: RequestStream, request_id: str) -> None:
        stream._on_admitted(request_id)

    def _rejected(self, stream: RequestStream, request_id: str, exc: BaseException) -> None:
        self._streams.pop(request_id, None)
        stream.fail(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.fail(exc)
        self._streams.clear()

    def _post(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while (not self._commands and not self._stopping
                           and not self.engine.has_unfinished):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                self._apply(commands)
                if stopping:
                    self._abort_all()
                    return
                if self.engine.has_unfinished:
                    self._step()
                self._publish()
        except Exception as exc:  # fail loudly (logged), then every in-flight request
            logger.exception("engine loop crashed; failing every in-flight request")
            self._dead_error = exc
            self._post(self._fail_all, EngineDeadError(f"engine loop crashed: {exc!r}"))
            with self._cond:
                self._num_queued_adds = 0
            # Not re-raised: the traceback is logged, /health turns 503, requests fail.

    def _apply(self, commands: list[_Command]) -> None:
        for cmd in commands:
            if cmd.kind == "add":
                with self._cond:
                    self._num_queued_adds -= 1
                try:
                    self.engine.add_request(cmd.request)
                except InvalidParameterError as exc:
                    self._post(self._rejected, cmd.stream, cmd.request.request_id, exc)
                    continue
                self._live_ids.add(cmd.request.request_id)
                self._post(self._admitted, cmd.stream, cmd.request.request_id)
            else:
                self.engine.abort(cmd.request_id)

    def _step(self) -> None:
        num_steps = self.engine.stats.num_steps
        start = time.monotonic()
        deltas = self.engine.step()
        step_s = time.monotonic() - start
        self._deliver(deltas)
        stepped = self.engine.stats.num_steps != num_steps
        if self.observer is not None and (stepped or deltas):
            try:
                self.observer(self.engine, deltas, step_s if stepped else None)
            except Exception:  # a metrics bug must not take the engine down
                logger.exception("step observer failed")
        if not deltas and self.engine.stats.num_steps == num_steps:
            # Nothing could be scheduled (should not happen: admission checks the pool);
            # wait for a command instead of spinning.
            with self._cond:
                if not self._commands and not self._stopping:
                    self._cond.wait(0.05)

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            if d.timings is not None:
                self._live_ids.discard(d.request_id)
        if deltas:
            self._post(self._dispatch, deltas)

    def _abort_all(self) -> None:
        for rid in list(self._live_ids):
            self.engine.abort(rid)
        while self.engine.has_unfinished:
            self._deliver(self.engine.step())
        self._post(self._fail_all, EngineDeadError("the engine was stopped"))
        self._publish()

    def _publish(self) -> None:
        sched = self.engine.scheduler
        bm = self.engine.block_manager
        running = {s.request_id for s in sched.running}
        waiting = {s.request_id for s in sched.waiting} - running
        self.snapshot = EngineSnapshot(
            num_running_requests=len(running), num_waiting_requests=len(waiting),
            num_used_blocks=bm.num_used_blocks, num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks, num_steps=self.engine.stats.num_steps)


__all__ = ["AsyncEngine", "EngineDeadError", "EngineSnapshot", "RequestStream", "merge_delta",
           "FinishReason"]
