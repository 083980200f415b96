"""EngineLoop: the one loop that drives an Engine, wherever its outputs go.

Owns: the command queue into the engine (add, abort, stop), the loop body (apply commands,
step, report), and the shutdown order (abort everything, step until nothing holds a block).
Its outputs go to a `LoopSink`: the in-process AsyncEngine posts them onto an asyncio event
loop; the engine core process (servelm/core_process/process.py) writes them to its socket.
The loop never waits on either: a sink only enqueues.
Never: touches tensors (the engine's runner does), or blocks on a consumer.

    any thread                      the loop's thread
    ----------                      -----------------
    add(req, token) --queue+cond--> engine.add_request(req)  -> sink.admitted / sink.rejected
    abort(rid)      --queue+cond--> engine.abort(rid)
    lora(op, ...)   --queue+cond--> engine.load_lora / unload_lora -> sink.lora_done
    stop()          --flag+cond---> abort all, drain          -> sink.stopped
                                    engine.step()             -> sink.outputs(deltas, report)
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from servelm.core.contract import KVEvent, StepReport
from servelm.protocol import EngineRequest, InvalidParameterError, TokenDelta

logger = logging.getLogger(__name__)


class LoopSink(Protocol):
    def admitted(self, request_id: str, token: Any, num_waiting_requests: int) -> None:
        """num_waiting_requests: the engine's queue once this batch of adds is in (so a
        front end's queue limit never sees an admitted request in neither count)."""
        ...

    def rejected(self, request_id: str, token: Any, exc: InvalidParameterError) -> None: ...

    def outputs(self, deltas: list[TokenDelta], report: StepReport,
                kv_events: list[KVEvent]) -> None: ...

    def dead(self, exc: BaseException) -> None: ...

    def stopped(self) -> None: ...

    def lora_done(self, token: Any, names: list[str], exc: Exception | None) -> None:
        """A LoRA load or unload finished (exc None) or was refused; names: the adapters
        loaded now."""
        ...


@dataclass
class _Command:
    kind: str  # "add" | "abort" | "load_lora" | "unload_lora"
    request: EngineRequest | None = None
    request_id: str = ""
    lora: tuple[str, str] = ("", "")  # (name, path) of a LoRA command
    token: Any = None  # handed back to the sink with the answer (the caller's stream)


class EngineLoop:
    def __init__(self, engine, sink: LoopSink):
        self.engine = engine
        self.sink = sink
        self._cond = threading.Condition()
        self._commands: list[_Command] = []
        self._num_queued_adds = 0
        self._stopping = False
        self.dead_error: BaseException | None = None
        self._live_ids: set[str] = set()  # loop thread only: admitted, not finished
        self.report: StepReport = engine.report()  # the last published (read anywhere)
        engine.enable_kv_events()  # a server publishes what its prefix cache holds
        engine.kv_connector.set_wake(self.wake)  # e.g. KV transfer messages wake an idle loop
        # --step-trace FILE: each step's shape and wall time (servelm/engine/step_trace.py).
        self.step_trace = None
        if getattr(getattr(engine, "engine_args", None), "step_trace", None):
            from servelm.engine.step_trace import open_step_trace

            self.step_trace = open_step_trace(engine)

    # -- any thread ------------------------------------------------------------------------

    def add(self, requests: list[EngineRequest], token: Any = None) -> None:
        with self._cond:
            for r in requests:
                self._commands.append(_Command("add", request=r, token=token))
                self._num_queued_adds += 1
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._commands.append(_Command("abort", request_id=request_id))
            self._cond.notify()

    def lora(self, op: str, name: str, path: str = "", token: Any = None) -> None:
        """op "load" or "unload" an adapter between steps; the answer goes to
        sink.lora_done(token, ...)."""
        if op not in ("load", "unload"):
            raise ValueError(f"lora op must be load or unload, got {op!r}")
        with self._cond:
            self._commands.append(_Command(f"{op}_lora", lora=(name, path), token=token))
            self._cond.notify()

    def wake(self) -> None:
        """Step soon: something the engine polls for has arrived (any thread)."""
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    @property
    def is_stopping(self) -> bool:
        return self._stopping

    @property
    def num_queued_adds(self) -> int:
        return self._num_queued_adds

    # -- the loop's thread -----------------------------------------------------------------

    def run(self) -> None:
        """The loop body; returns after stop() (everything aborted and freed) or a crash
        (logged, sink.dead called; never re-raised)."""
        try:
            while True:
                with self._cond:
                    while (not self._commands and not self._stopping
                           and not self.engine.has_unfinished):
                        if self.step_trace is not None:  # the last step ends here
                            self.step_trace.idle()
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                self._apply(commands)
                if stopping:
                    self._abort_all()
                    return
                if self.engine.has_unfinished:
                    self._step()
        except Exception as exc:  # fail loudly (logged), then every in-flight request
            logger.exception("engine loop crashed; failing every in-flight request")
            self.dead_error = exc
            with self._cond:
                self._num_queued_adds = 0
            self.sink.dead(exc)

    def _apply(self, commands: list[_Command]) -> None:
        admitted = []
        for cmd in commands:
            if cmd.kind == "add":
                rid = cmd.request.request_id
                try:
                    self.engine.add_request(cmd.request)
                except InvalidParameterError as exc:
                    with self._cond:
                        self._num_queued_adds -= 1
                    self.sink.rejected(rid, cmd.token, exc)
                    continue
                self._live_ids.add(rid)
                admitted.append(cmd)
                if self.step_trace is not None:
                    self.step_trace.admitted(cmd.request)
            elif cmd.kind in ("load_lora", "unload_lora"):
                self._apply_lora(cmd)
            else:
                self.engine.abort(cmd.request_id)
        if admitted:
            # The queue as it now is goes out with the admissions, before they stop counting
            # as queued adds: the sum a queue limit reads never misses them.
            waiting = self.engine.num_waiting_requests
            for cmd in admitted:
                self.sink.admitted(cmd.request.request_id, cmd.token, waiting)
            with self._cond:
                self._num_queued_adds -= len(admitted)

    def _apply_lora(self, cmd: _Command) -> None:
        name, path = cmd.lora
        try:
            if cmd.kind == "load_lora":
                self.engine.load_lora(name, path)
            else:
                self.engine.unload_lora(name)
        except InvalidParameterError as exc:
            self.sink.lora_done(cmd.token, self.engine.lora_names(), exc)
            return
        self.sink.lora_done(cmd.token, self.engine.lora_names(), None)

    def _step(self) -> None:
        num_steps = self.engine.stats.num_steps
        if self.step_trace is not None:
            self.step_trace.begin()
        start = time.monotonic()
        deltas = self.engine.step()
        stepped = self.engine.stats.num_steps != num_steps
        if stepped and self.step_trace is not None:
            self.step_trace.stepped(self.engine)
        self._deliver(deltas, time.monotonic() - start if stepped else None)
        if not deltas and not stepped:
            # Nothing could be scheduled (should not happen: admission checks the pool);
            # wait for a command instead of spinning.
            with self._cond:
                if not self._commands and not self._stopping:
                    self._cond.wait(0.05)

    def _deliver(self, deltas: list[TokenDelta], step_s: float | None) -> None:
        for d in deltas:
            if d.timings is not None:
                self._live_ids.discard(d.request_id)
        self.report = self.engine.report(step_s)
        # a KV transfer that began or ended between steps counts
        if deltas or step_s is not None or self.engine.kv_connector.take_changed():
            self.sink.outputs(deltas, self.report, self.engine.drain_kv_events())

    def _abort_all(self) -> None:
        for rid in list(self._live_ids):
            self.engine.abort(rid)
        self.engine.kv_connector.close()  # e.g. transfer channels close: transfers end now
        while self.engine.has_unfinished:
            num_steps = self.engine.stats.num_steps
            self._deliver(self.engine.step(), None)
            if self.engine.stats.num_steps == num_steps:  # only transfer timers left
                time.sleep(0.01)
        self.report = self.engine.report()
        if self.step_trace is not None:
            self.step_trace.close()
        self.sink.stopped()


__all__ = ["EngineLoop", "LoopSink"]
