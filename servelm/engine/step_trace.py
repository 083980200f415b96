"""The served-step trace: every step a serving engine ran, its shape and the wall time the
serving process spent on it, for fitting a StepCostModel to steps as they are served.

Owns: the trace file (JSON lines: one header naming the engine, then one line per step), the
writer the engine loop drives (`servelm serve --step-trace FILE`), and the reader
`servelm bench calibrate --served-steps FILE` fits from.
Never: changes what the engine does; it reads the last StepDescription and a clock.

A step's time here runs from its start to the start of the next step (or to the moment the
loop goes idle): the forward, and also the scheduling, detokenizing, delivering outputs and
taking in new requests between the two steps, and whatever the front end on the same cores
takes from the engine meanwhile. That is what a simulated step stands for: the simulator has
no other place to spend time, so a model fitted to lone-engine steps (`bench calibrate
MODEL`) comes out optimistic for a served engine.

    {"kind": "step-trace", "engine": {num_blocks, block_size, ...}}
    {"t": 1764612345.123, "s": 0.0312, "shape": [seqs, decode, decode ctx, prefill, pairs]}
    {"admit_s": 0.0021, "idle": true, "t": 1764612345.155}    a request taken into the engine

An admission line holds a request's time from the HTTP handler's stamp to the engine taking
it (`admit_s`), whether the loop was idle when it took it, and when (wall clock). The loop
takes new requests only between steps, so a request that arrives during a step waits for
that step's end, and its `admit_s` holds the rest of the step. The simulator models that
wait itself (a simulated request that arrives during a step waits for the next one); what
it needs as the cost model's `arrival_s` is only the front end's own part (parsing,
tokenizing, the hop into the engine), which is the whole lag only when the loop was idle:
`Admission.is_idle`. Traces written before the flag existed have it inferred from the line
order (`_infer_idle`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NamedTuple

from servelm.engine.step_cost_model import StepShape, step_shape

KIND = "step-trace"
_FLUSH_EVERY = 256  # steps; also flushed whenever the loop goes idle


def engine_block(engine) -> dict:
    """The engine the steps ran on, as a cost model's fit.engine records it (the simulator
    takes it as its replica)."""
    bm, sched = engine.block_manager, engine.scheduler.config
    return {"num_blocks": bm.num_blocks, "block_size": bm.block_size,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "enable_chunked_prefill": sched.enable_chunked_prefill,
            "enable_prefix_caching": bm.prefix_cache is not None,
            "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
            "eos_token_ids": sorted(engine.eos_token_ids)}


class StepTrace:
    """Driven by the engine loop's thread: begin() at each step's start, stepped() after
    Engine.step, idle() before the loop waits for work, close() when it stops."""

    def __init__(self, path: str | Path, engine, clock=time.monotonic):
        self.clock = clock
        self._file = open(path, "w")  # noqa: SIM115 (open for the loop's life)
        self._file.write(json.dumps({"kind": KIND, "engine": engine_block(engine)}) + "\n")
        self._file.flush()
        self._start: float | None = None  # the current step's start (clock)
        self._pending: tuple[float, StepShape] | None = None  # a step waiting for its end
        self._unflushed = 0
        self.num_steps = 0

    def begin(self) -> None:
        now = self.clock()
        self._end(now)
        self._start = now

    def stepped(self, engine) -> None:
        """Engine.step ran a step (the caller checked): remember its shape until it ends."""
        self._pending = (self._start, step_shape(engine.last_step_description))

    def admitted(self, request) -> None:
        """The loop put `request` into the engine; its arrival_time is the front end's
        (the same monotonic clock, in this process or the engine core's). The loop was idle
        unless a step ran since the last begin() and has not ended: the loop admits between
        Engine.step and the next begin(), and idle() ends the last step before it waits."""
        if request.arrival_time is not None:
            now = self.clock()
            lag = max(0.0, now - request.arrival_time)
            self._file.write(json.dumps({"admit_s": lag, "idle": self._pending is None,
                                         "t": round(time.time() - (self.clock() - now), 6)})
                             + "\n")

    def idle(self) -> None:
        self._end(self.clock())
        self._file.flush()
        self._unflushed = 0

    def close(self) -> None:
        if not self._file.closed:
            self.idle()
            self._file.close()

    def _end(self, now: float) -> None:
        if self._pending is None:
            return
        start, shape = self._pending
        self._pending = None
        # Wall-clock time of the start (the clock is monotonic), to line steps up with a
        # client's record of the same run.
        wall = time.time() - (self.clock() - start)
        self._file.write(json.dumps({"t": round(wall, 6), "s": now - start,
                                     "shape": list(shape)}) + "\n")
        self.num_steps += 1
        self._unflushed += 1
        if self._unflushed >= _FLUSH_EVERY:
            self._file.flush()
            self._unflushed = 0


def open_step_trace(engine) -> StepTrace | None:
    """The trace `--step-trace FILE` asks for (EngineArgs.step_trace), or None."""
    path = getattr(getattr(engine, "engine_args", None), "step_trace", None)
    return StepTrace(path, engine) if path else None


class Admission(NamedTuple):
    lag_s: float  # the HTTP handler's stamp -> the engine taking the request
    is_idle: bool  # the loop was waiting for work: the lag is the front end's alone


class StepTraceData(NamedTuple):
    engine: dict  # engine_block() of the engine that ran the steps
    shapes: list[StepShape]
    seconds: list[float]  # per step, start to next start
    admissions: list[Admission]  # per admitted request, in the order the engine took them


# A step that ended at idle() and the next step's start are apart by at least the time the
# loop waited; one begin() ends a step and starts the next at the same clock reading, so
# back-to-back steps' lines differ only by the wall-clock conversion's rounding (~1 us).
_IDLE_GAP_S = 5e-4


def _read_rows(path: str | Path) -> tuple[dict, list[dict]]:
    """A trace file's header and rows (admissions' idle flags inferred where an older trace
    lacks them); a file that is not a trace is refused."""
    lines = Path(path).read_text().splitlines()
    head = json.loads(lines[0]) if lines else {}
    if head.get("kind") != KIND:
        raise ValueError(f"{path} is not a step trace (servelm serve --step-trace)")
    rows = [json.loads(line) for line in lines[1:] if line.strip()]
    if any("admit_s" in r and "idle" not in r for r in rows):
        rows = _infer_idle(rows)
    return head, rows


def read_step_trace(path: str | Path) -> StepTraceData:
    """A trace file's steps and admissions; a file that is not a trace is refused."""
    head, rows = _read_rows(path)
    shapes, seconds, admissions = [], [], []
    for row in rows:
        if "admit_s" in row:
            admissions.append(Admission(float(row["admit_s"]), bool(row["idle"])))
        else:
            shapes.append(StepShape(*row["shape"]))
            seconds.append(float(row["s"]))
    return StepTraceData(head["engine"], shapes, seconds, admissions)


class TimedStep(NamedTuple):
    t: float  # wall-clock start (s since the epoch)
    s: float  # start to next start
    shape: StepShape


class TimedAdmission(NamedTuple):
    t: float  # wall clock when the engine took the request
    admission: Admission


def read_timed_trace(path: str | Path) -> tuple[dict, list[TimedStep], list[TimedAdmission]]:
    """A trace's steps and admissions with their wall-clock times, to split one server's
    trace into the windows of the runs it served (a client's record has the same clock)."""
    head, rows = _read_rows(path)
    steps = [TimedStep(float(r["t"]), float(r["s"]), StepShape(*r["shape"]))
             for r in rows if "shape" in r]
    admissions = [TimedAdmission(float(r.get("t", 0.0)),
                                 Admission(float(r["admit_s"]), bool(r["idle"])))
                  for r in rows if "admit_s" in r]
    return head["engine"], steps, admissions


def _infer_idle(rows: list[dict]) -> list[dict]:
    """Admission lines without the `idle` flag (older traces): a step's line is written when
    it ends, at the next begin() or at idle(), and admissions are written between the two
    steps' lines. After a step that ended at idle(), the next step starts a gap later (the
    wait); the first admission written after that step's line is the request that woke the
    loop (idle), any later one in the same group arrived while the next step ran. Between
    back-to-back steps every admission waited for a step. The first request of a file woke
    the loop. (A second request taken in the same wake-up counts as busy here: the line
    order cannot tell it apart; the flag written since can.)"""
    out = [dict(r) for r in rows]
    prev_step: dict | None = None
    group: list[dict] = []

    def settle(next_step: dict | None) -> None:
        woke = prev_step is None or next_step is None or (
            next_step["t"] - (prev_step["t"] + prev_step["s"]) > _IDLE_GAP_S)
        for i, adm in enumerate(group):
            adm.setdefault("idle", woke and i == 0)
        group.clear()

    for row in out:
        if "admit_s" in row:
            group.append(row)
        else:
            settle(row)
            prev_step = row
    settle(None)
    return out


__all__ = ["Admission", "StepTrace", "StepTraceData", "engine_block", "open_step_trace",
           "read_step_trace"]
