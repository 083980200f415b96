"""AsyncEngine: an Engine driven by its own thread, consumed from an asyncio event loop.

Owns: `StreamRouter`, the event-loop side every engine client shares (per-request
`RequestStream`s, dispatch of deltas, failing everything when the engine dies; the engine
core client in servelm/core_process/client.py is the other one), and `AsyncEngine`, which
runs an `EngineLoop` (servelm/engine/engine_loop.py) on a thread of this process and feeds the
streams with loop.call_soon_threadsafe. Never: waits on a client (delivery is fire-and-forget
into the loop), or runs engine code on the event loop.

    event loop                         engine thread (EngineLoop.run)
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

from servelm.core.contract import StepReport
from servelm.core.kv_event_log import KVEventLog
from servelm.engine.engine_loop import EngineLoop
from servelm.protocol import EngineRequest, FinishReason, TokenDelta

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


class StreamRouter:
    """The event-loop side of an engine client: request streams and their dispatch.
    Subclasses send commands (`_send_add`, `_send_abort`) and say whether the engine lives."""

    # What a front end needs to know of the engine, set by each client.
    tokenizer = None
    vocab_size: int = 0
    max_model_len: int = 0
    model_name: str = ""
    block_size: int = 0  # KV block size (a router hashes prompts in these blocks)
    lora_names: list[str] = []  # LoRA adapters loaded (served as model names)

    def __init__(self):
        self.kv_events = KVEventLog()  # the engine's prefix-cache events (GET /v1/kv_events)
        self._streams: dict[str, RequestStream] = {}  # loop side
        self._loop: asyncio.AbstractEventLoop | None = None
        self.snapshot = StepReport()  # the engine's last report (metrics, /health)

    # -- subclass hooks --------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    @property
    def num_queued_adds(self) -> int:
        raise NotImplementedError

    def _send_add(self, requests: list[EngineRequest], stream: RequestStream) -> None:
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _send_lora(self, op: str, name: str, path: str, done: asyncio.Future) -> None:
        raise NotImplementedError

    # -- event-loop API --------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not yet scheduled (incl. those still crossing to the engine)."""
        return self.num_queued_adds + self.snapshot.num_waiting_requests

    def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue requests for the engine; their deltas go to one RequestStream.
        `await stream.admitted` raises InvalidParameterError if the engine rejects one."""
        stream = RequestStream([r.request_id for r in requests])
        if not self.is_alive:
            stream.fail(EngineDeadError("the engine is not running"))
            return stream
        for r in requests:
            self._streams[r.request_id] = stream
        self._send_add(requests, stream)
        return stream

    def abort(self, request_id: str) -> None:
        """The request's last delta (finish_reason abort) comes with the engine's next step;
        its blocks are freed as soon as the engine takes the command."""
        self._send_abort(request_id)

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

    async def load_lora(self, name: str, path: str) -> None:
        """Register a LoRA adapter with the engine (checked there against the base model);
        raises InvalidParameterError naming the field when it is refused."""
        await self._lora("load", name, path)

    async def unload_lora(self, name: str) -> None:
        """Unregister an adapter: new requests for it are refused at once, requests using it
        run to their end first (servelm/lora/slots.py)."""
        await self._lora("unload", name, "")

    async def _lora(self, op: str, name: str, path: str) -> None:
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        done = asyncio.get_running_loop().create_future()
        self._send_lora(op, name, path, done)
        await done

    def _lora_done(self, done: asyncio.Future, names: list[str],
                   exc: BaseException | None) -> None:
        self.lora_names = list(names)
        if done.done():
            return
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

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

    def _post(self, fn, *args) -> None:
        """From another thread: run fn(*args) on the loop (dropped once the loop is closed)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None:
                continue
            stream.put(d)
            if d.timings is not None:
                self._streams.pop(d.request_id, None)

    def _admitted(self, stream: RequestStream | None, request_id: str) -> None:
        stream = stream or self._streams.get(request_id)
        if stream is not None:
            stream._on_admitted(request_id)

    def _rejected(self, stream: RequestStream | None, request_id: str,
                  exc: BaseException) -> None:
        stream = stream or self._streams.get(request_id)
        if self._streams.get(request_id) is stream:
            self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.fail(exc)
        self._streams.clear()


class _PostingSink:
    """EngineLoop outputs -> the event loop (AsyncEngine). Runs on the engine thread."""

    def __init__(self, owner: AsyncEngine):
        self.owner = owner

    def admitted(self, request_id, stream, num_waiting_requests) -> None:
        self.owner.snapshot.num_waiting_requests = num_waiting_requests
        self.owner._post(self.owner._admitted, stream, request_id)

    def rejected(self, request_id, stream, exc) -> None:
        self.owner._post(self.owner._rejected, stream, request_id, exc)

    def outputs(self, deltas, report, kv_events) -> None:
        owner = self.owner
        owner.snapshot = report
        if kv_events:
            owner.kv_events.extend(kv_events)
        if owner.observer is not None:
            try:
                owner.observer(report, deltas)
            except Exception:  # a metrics bug must not take the engine down
                logger.exception("step observer failed")
        if deltas:
            owner._post(owner._dispatch, deltas)

    def dead(self, exc) -> None:
        self.owner._post(self.owner._fail_all, EngineDeadError(f"engine loop crashed: {exc!r}"))

    def lora_done(self, done, names, exc) -> None:
        self.owner._post(self.owner._lora_done, done, names, exc)

    def stopped(self) -> None:
        self.owner.snapshot = self.owner._body.report
        self.owner._post(self.owner._fail_all, EngineDeadError("the engine was stopped"))


class AsyncEngine(StreamRouter):
    """Runs `engine` on a dedicated thread of this process. `observer(report, deltas)` is
    called on the engine thread after each step (metrics; report.step_s is None when no model
    step ran, e.g. only abort deltas came out); it must be cheap and must not block."""

    def __init__(self, engine, observer: Callable | None = None):
        super().__init__()
        self.engine = engine
        self.observer = observer
        self._body = EngineLoop(engine, _PostingSink(self))
        self._thread: threading.Thread | None = None
        self.snapshot = self._body.report
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        self.max_model_len = engine.max_model_len
        self.model_name = engine.model_name
        self.block_size = engine.block_manager.block_size
        self.lora_names = engine.lora_names() if hasattr(engine, "lora_names") else []

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._body.run, name="servelm-engine",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort everything in flight and join the engine thread."""
        self._body.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()
                and not self._body.is_stopping and self._body.dead_error is None)

    @property
    def num_queued_adds(self) -> int:
        return self._body.num_queued_adds

    def _send_add(self, requests: list[EngineRequest], stream: RequestStream) -> None:
        self._body.add(requests, stream)

    def _send_abort(self, request_id: str) -> None:
        self._body.abort(request_id)

    def _send_lora(self, op: str, name: str, path: str, done: asyncio.Future) -> None:
        self._body.lora(op, name, path, done)


__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream", "StreamRouter", "merge_delta",
           "FinishReason"]
