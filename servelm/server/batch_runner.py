"""BatchRunner: runs the store's batches on this replica, as the lowest SLO class.

Owns: claiming batches from the state store (those created for the model it serves; one
replica runs a batch at a time, under a lease it touches every second, so a replica that
died leaves its batch to another after `lease_s`), each batch's life (validating ->
in_progress -> finalizing -> completed;
cancelling -> cancelled; past its window -> expired; a malformed input file -> failed),
running its lines through the endpoint code that serves HTTP (an in-process request: the same
validation, templates, parsers, limits and logs), pacing, recording each line's result in
the store as it finishes, the output and error files, and the backlog gauges.

Pacing: a line is submitted while fewer than `max_inflight` lines run and either nothing
waits in the engine's queue (idle capacity) or the batch has fewer lines running than the
seats its window is owed (servelm/server/batch_pacer.py: from the lines left, the measured
line time and the time left; none while the batch has slack, more as its deadline nears).
Batch work fills the seats interactive traffic leaves idle and queues ahead of it only to
meet its window; each line also carries the lowest class of the SLO spec, so the SLO
scheduling policy orders it after every other class.
Never: runs a line whose result is stored (a resumed batch skips those), keeps a batch's
progress only in memory, or calls the store on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Gauge
from starlette.requests import Request
from starlette.responses import Response

from servelm.server.batch_input import BatchInputError, BatchLine, parse_batch_input
from servelm.server.batch_pacer import BatchPacer
from servelm.server.files_serving import file_object
from servelm.server.admission import SLO_CLASS_SCOPE_KEY
from servelm.server.state_store import BatchResult

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
StoreCall = Callable[..., Awaitable[Any]]  # AsyncStore.call: (method, *args)

_RETRY_STATUSES = (429, 503)  # a full queue, an unattainable SLO, a busy engine: later


@dataclass(frozen=True)
class BatchLimits:
    max_inflight: int = 8  # lines of this replica's batches in the engine at once
    max_running_batches: int = 2  # batches this replica works on at once
    max_lines: int = 50_000  # requests per input file
    lease_s: float = 30.0
    heartbeat_s: float = 1.0
    poll_s: float = 1.0  # how often an idle runner looks for a batch in the store
    pace_s: float = 0.02  # how often a paced line looks at the engine's queue again
    # A batch's line time before one of its lines has finished (the pacer's guess), and the
    # pacer's margin: the seats it is owed finish its lines in the time left / margin
    prior_line_s: float = 10.0
    pace_margin: float = 2.0


@dataclass
class _Job:
    body: dict[str, Any]
    pacer: BatchPacer
    lines: list[BatchLine] = field(default_factory=list)
    num_done: int = 0
    num_running: int = 0  # its lines submitted and not yet finished
    stop: str | None = None  # "cancelled", "expired", "shutdown", "lost" or "failed"
    running: dict[int, asyncio.Event] = field(default_factory=dict)  # line -> its cancel

    @property
    def id(self) -> str:
        return self.body["id"]

    @property
    def num_left(self) -> int:
        return len(self.lines) - self.num_done

    def halt(self, why: str) -> None:
        """Submit nothing more; the lines in flight are aborted (not recorded)."""
        if self.stop is None:
            self.stop = why
        for cancel in self.running.values():
            cancel.set()


class BatchRunner:
    def __init__(self, handlers: dict[str, Handler], db: StoreCall, engine, slo_class: str,
                 model: str, limits: BatchLimits = BatchLimits(), registry=None,
                 draining: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.time):
        self.handlers = handlers  # endpoint path -> the route's handler
        self.db = db
        self.engine = engine  # the engine client: its num_waiting is the pacing signal
        # The server drains (SIGTERM): submit nothing more, and a line the drain aborted is
        # not a result (it runs again where the batch resumes).
        self.draining = draining
        self.slo_class = slo_class
        self.model = model
        self.limits = limits
        self.clock = clock  # wall time: a window's end is a Unix time
        self.owner = f"replica-{uuid.uuid4().hex}"
        self._jobs: dict[str, _Job] = {}
        self._tasks: set[asyncio.Task] = set()
        self._num_running = 0
        self._wake = asyncio.Event()
        self._stopping = False
        if registry is not None:
            self._gauges(registry)

    # -- the claim loop ----------------------------------------------------------------------

    def wake(self) -> None:
        """A batch was created: look for it now, not at the next poll."""
        self._wake.set()

    async def run(self) -> None:
        """Claims and runs batches until cancelled (the app's lifespan runs it)."""
        failing = False
        while not self._stopping:
            body = None
            if len(self._jobs) < self.limits.max_running_batches and not self.draining():
                try:
                    body = await self.db("claim_batch", self.owner, self.limits.lease_s,
                                         self.model)
                    failing = False
                except Exception:  # a store outage: said once, tried again at each poll
                    if not failing:
                        logger.exception("batch runner: claiming a batch failed")
                    failing = True
            if body is not None:
                pacer = BatchPacer(self.limits.prior_line_s, self.limits.pace_margin)
                job = self._jobs[body["id"]] = _Job(body, pacer)
                task = asyncio.ensure_future(self._run_job(job))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.limits.poll_s)
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> None:
        """Abort the lines in flight and hand the batches back (unrecorded lines run again
        wherever the batch resumes)."""
        self._stopping = True
        self._wake.set()
        for job in list(self._jobs.values()):
            job.halt("shutdown")
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=30)

    # -- one batch ---------------------------------------------------------------------------

    async def _run_job(self, job: _Job) -> None:
        heartbeat = asyncio.ensure_future(self._heartbeat(job))
        try:
            status = job.body["status"]
            if status in ("validating", "in_progress") and not await self._load_lines(job):
                return
            if job.body["status"] == "in_progress":
                await self._run_lines(job)
            final = {None: "completed", "cancelled": "cancelled", "expired": "expired"}
            if job.body["status"] == "cancelling":
                job.stop = job.stop or "cancelled"
            if job.stop in final:
                await self._finalize(job, final[job.stop])
        except Exception:  # kept held: tried again once its lease runs out, not in a loop
            logger.exception("batch %s: the runner failed; another try after its lease",
                             job.id)
            job.stop = "failed"
        finally:
            heartbeat.cancel()
            self._jobs.pop(job.id, None)
            if job.stop != "failed":
                # A finished batch has no owner already; any other may resume it at once.
                await _quietly(self.db("release_batch", job.id, self.owner))
            self._wake.set()

    async def _load_lines(self, job: _Job) -> bool:
        """The input file's lines; a new batch goes in_progress, a malformed one fails.
        False when the batch is over (failed, or its input file is gone)."""
        content = await self.db("file_content", job.body["input_file_id"])
        try:
            if content is None:
                raise BatchInputError([{"code": "invalid_file", "param": "input_file_id",
                                        "line": None, "message": "the input file was "
                                        "deleted before the batch ran"}])
            job.lines = await asyncio.to_thread(parse_batch_input, content,
                                                job.body["endpoint"], self.limits.max_lines)
        except BatchInputError as exc:
            body = dict(job.body, status="failed", failed_at=int(self.clock()),
                        errors={"object": "list", "data": exc.errors})
            if await self.db("finish_batch", body, [], self.owner):
                job.body = body
            return False
        if job.body["status"] == "validating":
            body = dict(job.body, status="in_progress", in_progress_at=int(self.clock()),
                        request_counts={"total": len(job.lines), "completed": 0, "failed": 0})
            if await self.db("update_batch", body, only_if_status=("validating",),
                             owner=self.owner):
                job.body = body
            else:  # cancelled while validating
                job.body = await self.db("get_batch", job.id) or job.body
        return True

    async def _heartbeat(self, job: _Job) -> None:
        while True:
            await asyncio.sleep(self.limits.heartbeat_s)
            try:
                status = await self.db("heartbeat_batch", job.id, self.owner)
            except Exception:  # a store outage: the lines go on; the lease may run out
                logger.exception("batch %s: heartbeat failed", job.id)
                continue
            if status is None:
                job.halt("lost")  # its lease ran out and another replica holds it
            elif status == "cancelling":
                job.body["status"] = "cancelling"
                job.halt("cancelled")

    async def _run_lines(self, job: _Job) -> None:
        done = {r.line for r in await self.db("batch_results", job.id)}
        job.num_done = len(done)
        tasks: set[asyncio.Task] = set()
        for line in job.lines:
            if line.line in done:
                continue
            if not await self._wait_for_room(job):
                break
            self._num_running += 1  # now: the task starts only at the loop's next turn
            job.num_running += 1
            task = asyncio.ensure_future(self._run_line(job, line))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.wait(set(tasks))

    async def _wait_for_room(self, job: _Job, num_held: int = 0) -> bool:
        """Until a seat is free (a retried line holds its own: num_held 1) and either
        nothing waits in the engine's queue or the batch is owed more seats than its lines
        hold; False when the batch must stop (cancelled, expired, shut down)."""
        expires_at = job.body.get("expires_at") or float("inf")
        while job.stop is None:
            if self.draining():  # the lines in flight may still finish within the drain
                job.stop = "shutdown"
                break
            now = self.clock()
            if now >= expires_at:
                job.halt("expired")
                break
            if self._num_running - num_held < self.limits.max_inflight and (
                    self.engine.num_waiting == 0
                    or job.num_running - num_held < self._owed(job, now)):
                return True
            await asyncio.sleep(self.limits.pace_s)
        return False

    def _owed(self, job: _Job, now: float) -> int:
        """Seats the batch may fill ahead of a non-empty queue to meet its window."""
        expires_at = job.body.get("expires_at") or float("inf")
        return job.pacer.owed_seats(job.num_left, expires_at - now, self.limits.max_inflight)

    async def _run_line(self, job: _Job, line: BatchLine) -> None:
        """One line (counted in _num_running by its submitter) to its recorded result."""
        cancel = job.running[line.line] = asyncio.Event()
        if job.stop is not None:
            cancel.set()
        start = self.clock()
        try:
            status, payload = await self._attempts(job, line, cancel)
            stopping = cancel.is_set() or self.draining()
            if status == 499 or (stopping and (status >= 400 or _was_aborted(payload))):
                return  # aborted by a stop: it runs again where the batch resumes
            job.pacer.observe(self.clock() - start)
            if await self.db("put_batch_result", job.id, _result(line, status, payload)):
                job.num_done += 1
        except Exception:  # a store outage: the line runs again where the batch resumes
            logger.exception("batch %s: the result of line %d was not stored", job.id,
                             line.line)
        finally:
            self._num_running -= 1
            job.num_running -= 1
            job.running.pop(line.line, None)

    async def _attempts(self, job: _Job, line: BatchLine,
                        cancel: asyncio.Event) -> tuple[int, dict[str, Any]]:
        """The line's response; one refused for load (429, 503) tries again when there is
        room; 499 when the batch stopped first."""
        delay = 0.2
        while True:
            try:
                status, payload = await self._call(job.body["endpoint"], line.body, cancel)
            except Exception:  # as over HTTP: a 500 for this line; the batch goes on
                logger.exception("batch %s: line %d failed to run", job.id, line.line)
                return 500, {"error": {"message": "internal server error",
                                       "type": "server_error", "code": "internal_error"}}
            if status not in _RETRY_STATUSES or cancel.is_set():
                return status, payload
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            if not await self._wait_for_room(job, num_held=1):
                return 499, {}

    async def _call(self, endpoint: str, body: dict[str, Any],
                    cancel: asyncio.Event) -> tuple[int, dict[str, Any]]:
        """One line through the endpoint's handler, as an HTTP request of this server
        would run; `cancel` reads to the handler as the client disconnecting."""
        raw = json.dumps(body, ensure_ascii=False).encode()
        scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": endpoint, "raw_path": endpoint.encode(), "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 0), "server": ("batch", 0),
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(raw)).encode())],
                 SLO_CLASS_SCOPE_KEY: self.slo_class}
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await cancel.wait()
            return {"type": "http.disconnect"}

        response = await self.handlers[endpoint](Request(scope, receive))
        try:
            payload = json.loads(bytes(response.body)) if response.body else {}
        except ValueError:
            payload = {"error": {"message": bytes(response.body)[:200].decode(errors="replace"),
                                 "code": "invalid_response"}}
        return response.status_code, payload if isinstance(payload, dict) else {}

    # -- the end of a batch ------------------------------------------------------------------

    async def _finalize(self, job: _Job, final: str) -> None:
        """The output and error files and the final body, stored together."""
        now = int(self.clock())
        if final == "completed" and job.body["status"] == "in_progress":
            body = dict(job.body, status="finalizing", finalizing_at=now)
            if not await self.db("update_batch", body, only_if_status=("in_progress",),
                                 owner=self.owner):
                final = "cancelled"  # a cancel came in as the last line finished
        body = await self.db("get_batch", job.id)
        if body is None:
            return
        results = await self.db("batch_results", job.id)
        output = [r.body for r in results if not r.is_error]
        errors = [r.body for r in results if r.is_error]
        if final == "expired":
            done = {r.line for r in results}
            errors += [_expired(line) for line in job.lines if line.line not in done]
        files = []
        for kind, rows in (("output", output), ("error", errors)):
            if rows:
                content = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
                meta = file_object(f"{job.id}_{kind}.jsonl", "batch_output",
                                   len(content.encode()))
                files.append((meta, content.encode()))
                body[f"{kind}_file_id"] = meta["id"]
        total = body.get("request_counts", {}).get("total", len(job.lines))
        body.update({"status": final, f"{final}_at": now, "usage": _usage(output),
                     "request_counts": {"total": total, "completed": len(output),
                                        "failed": len(errors)}})
        if await self.db("finish_batch", body, files, self.owner):
            job.body = body

    # -- metrics -----------------------------------------------------------------------------

    def _gauges(self, registry) -> None:
        Gauge("servelm_batch_requests_pending", "Lines of the batches this replica runs "
              "that have no result yet (the batch backlog)", registry=registry
              ).set_function(lambda: sum(len(j.lines) - j.num_done
                                         for j in list(self._jobs.values())))
        Gauge("servelm_batch_requests_running", "Batch lines in the engine now",
              registry=registry).set_function(lambda: self._num_running)
        Gauge("servelm_batches_running", "Batches this replica runs now",
              registry=registry).set_function(lambda: len(self._jobs))
        Gauge("servelm_batch_paced_seats", "Seats the batches this replica runs are owed "
              "ahead of a non-empty queue to meet their windows", registry=registry
              ).set_function(lambda: sum(self._owed(j, self.clock())
                                         for j in list(self._jobs.values())))
        Gauge("servelm_batch_line_rate", "Batch lines a second this replica finishes with "
              "all its batch seats, at the measured line time (NaN: none measured yet)",
              registry=registry).set_function(self.line_rate)
        Gauge("servelm_batch_deadline_seconds", "Seconds until the earliest window of the "
              "batches this replica runs closes (NaN: none)", registry=registry
              ).set_function(self._deadline_s)

    def _deadline_s(self) -> float:
        ends = [j.body.get("expires_at") for j in list(self._jobs.values())]
        ends = [e for e in ends if e]
        return min(ends) - self.clock() if ends else float("nan")

    def line_rate(self) -> float:
        """Lines a second at max_inflight seats, from the line time measured on the batches
        this replica runs (NaN before any line finished): the autoscaler's per-replica
        rate for the batch backlog."""
        times = [j.pacer.line_s for j in list(self._jobs.values()) if j.pacer.num_measured]
        if not times:
            return float("nan")
        return self.limits.max_inflight / max(sum(times) / len(times), 1e-9)


def _result(line: BatchLine, status: int, payload: dict[str, Any]) -> BatchResult:
    """A line's output-file line (2xx) or error-file line, in OpenAI's shape."""
    rid = f"batch_req_{uuid.uuid4().hex}"
    response = {"status_code": status, "request_id": payload.get("id") or rid,
                "body": payload}
    if 200 <= status < 300:
        return BatchResult(line.line, False, {"id": rid, "custom_id": line.custom_id,
                                              "response": response, "error": None})
    err = payload.get("error") if isinstance(payload.get("error"), dict) else {}
    return BatchResult(line.line, True, {
        "id": rid, "custom_id": line.custom_id, "response": response,
        "error": {"code": err.get("code") or "request_failed",
                  "message": err.get("message") or f"the request failed with HTTP {status}"}})


def _was_aborted(payload: dict[str, Any]) -> bool:
    """A completion or chat answer cut short by an abort (a drain past its grace)."""
    return any(isinstance(c, dict) and c.get("finish_reason") == "abort"
               for c in payload.get("choices") or [])


def _expired(line: BatchLine) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": None, "error": {"code": "batch_expired", "message": "This request "
                                        "could not be executed before the completion window "
                                        "expired."}}


def _usage(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch's tokens, summed over its successful lines (chat/completions/embeddings
    count prompt/completion tokens, responses input/output tokens)."""
    num_in = num_out = num_cached = num_reasoning = 0
    for row in output:
        usage = row["response"]["body"].get("usage") or {}
        num_in += usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
        num_out += usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        num_cached += details.get("cached_tokens", 0) or 0
        details = (usage.get("completion_tokens_details")
                   or usage.get("output_tokens_details") or {})
        num_reasoning += details.get("reasoning_tokens", 0) or 0
    return {"input_tokens": num_in, "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens": num_out, "output_tokens_details": {"reasoning_tokens":
                                                                num_reasoning},
            "total_tokens": num_in + num_out}


async def _quietly(call: Awaitable[Any]) -> None:
    try:
        await call
    except Exception:
        logger.exception("batch runner: a store call failed")


__all__ = ["BatchLimits", "BatchRunner"]
