"""The batch runner with stand-in endpoints and engine, on a real SQLite store: a line enters
only while nothing waits in the engine's queue and a seat is free; a line refused for load
runs again and is recorded once; a line whose handler raises fails alone; a resumed batch
runs only the lines with no stored result; every line carries the class it was given; a
draining server submits no more lines, records none its drain aborted, and hands the batch
back."""

from __future__ import annotations

import asyncio
import json

from starlette.responses import JSONResponse

from servelm.server.async_store import AsyncStore
from servelm.server.batch_runner import BatchLimits, BatchRunner
from servelm.server.files_serving import file_object
from servelm.server.admission import SLO_CLASS_SCOPE_KEY
from servelm.server.state_store import BatchResult, SQLiteStateStore

URL = "/v1/chat/completions"


class FakeEngine:
    num_waiting = 0


class Endpoint:
    """A stand-in handler: records each call, answers when released."""

    def __init__(self, answers=None):
        self.calls: list[tuple[str, str]] = []  # (custom text, SLO class)
        self.running = 0
        self.max_running = 0
        self.release = asyncio.Event()
        self.answers = answers or {}  # text -> list of statuses to answer in turn

    async def __call__(self, request):
        body = await request.json()
        text = body["messages"][0]["content"]
        self.calls.append((text, request.scope[SLO_CLASS_SCOPE_KEY]))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self.release.wait()
            statuses = self.answers.get(text)
            status = statuses.pop(0) if statuses else 200
            if status == "raise":
                raise RuntimeError("boom")
            if status == "abort":
                return JSONResponse({"id": "x", "choices": [{"finish_reason": "abort"}]})
            return JSONResponse({"id": f"chatcmpl-{text}", "usage": {
                "prompt_tokens": 3, "completion_tokens": 2}} if status == 200 else
                {"error": {"message": "busy", "code": "queue_full"}}, status_code=status)
        finally:
            self.running -= 1


def _line(i: int) -> dict:
    return {"custom_id": f"c{i}", "method": "POST", "url": URL,
            "body": {"messages": [{"role": "user", "content": f"t{i}"}]}}


def _batch(store: SQLiteStateStore, num_lines: int) -> str:
    content = "".join(json.dumps(_line(i)) + "\n" for i in range(num_lines)).encode()
    meta = file_object("in.jsonl", "batch", len(content))
    store.put_file(meta, content)
    body = {"id": "batch_1", "object": "batch", "endpoint": URL, "status": "validating",
            "model": "m",
            "input_file_id": meta["id"], "expires_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}}
    store.put_batch(body)
    return body["id"]


async def _until(predicate, what: str) -> None:
    for _ in range(20000):  # a hang guard, not a bound on the speed
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def _runner(store: AsyncStore, endpoint: Endpoint, engine: FakeEngine,
            max_inflight: int = 2, draining=lambda: False) -> BatchRunner:
    limits = BatchLimits(max_inflight=max_inflight, poll_s=0.01, pace_s=0.005,
                         heartbeat_s=0.05)
    return BatchRunner({URL: endpoint}, store.call, engine, "batch", "m", limits,
                       draining=draining)


def test_lines_wait_for_an_empty_queue_and_a_free_seat(tmp_path):
    path = tmp_path / "s.sqlite3"
    batch_id = _batch(SQLiteStateStore(path), 6)

    async def main():
        store, engine, endpoint = AsyncStore(f"sqlite:///{path}"), FakeEngine(), Endpoint()
        engine.num_waiting = 1  # an interactive request waits for a seat
        runner = _runner(store, endpoint, engine)
        task = asyncio.ensure_future(runner.run())
        await _until(lambda: runner._jobs and runner._jobs[batch_id].lines, "validated")
        for _ in range(50):  # the runner polls the queue all this while
            await asyncio.sleep(0.005)
        assert endpoint.calls == []
        engine.num_waiting = 0
        await _until(lambda: len(endpoint.calls) == 2, "two lines in")
        await asyncio.sleep(0.05)
        assert len(endpoint.calls) == 2  # both seats taken: the third waits
        endpoint.release.set()
        await _until(lambda: batch_id not in runner._jobs, "finished")
        await runner.stop()
        task.cancel()
        body = await store.call("get_batch", batch_id)
        await store.close()
        return endpoint, body

    endpoint, body = asyncio.run(main())
    assert endpoint.max_running == 2
    assert [c for _, c in endpoint.calls] == ["batch"] * 6
    assert body["status"] == "completed" and body["request_counts"] == {
        "total": 6, "completed": 6, "failed": 0}
    assert body["usage"]["input_tokens"] == 18 and body["usage"]["output_tokens"] == 12


def test_refused_lines_retry_and_a_raising_line_fails_alone(tmp_path):
    path = tmp_path / "s.sqlite3"
    batch_id = _batch(SQLiteStateStore(path), 3)

    async def main():
        store, engine = AsyncStore(f"sqlite:///{path}"), FakeEngine()
        endpoint = Endpoint({"t0": [429, 503, 200], "t1": ["raise"]})
        endpoint.release.set()
        runner = _runner(store, endpoint, engine, max_inflight=1)
        task = asyncio.ensure_future(runner.run())
        await _until(lambda: runner._jobs, "claimed")
        await _until(lambda: batch_id not in runner._jobs, "finished")
        await runner.stop()
        task.cancel()
        results = await store.call("batch_results", batch_id)
        await store.close()
        return endpoint, results

    endpoint, results = asyncio.run(main())
    assert [t for t, _ in endpoint.calls] == ["t0", "t0", "t0", "t1", "t2"]
    assert [(r.line, r.is_error) for r in results] == [(1, False), (2, True), (3, False)]
    assert results[1].body["response"]["status_code"] == 500
    assert results[1].body["error"]["code"] == "internal_error"


def test_a_resumed_batch_runs_only_the_lines_without_a_result(tmp_path):
    path = tmp_path / "s.sqlite3"
    sync = SQLiteStateStore(path)
    batch_id = _batch(sync, 5)
    body = dict(sync.get_batch(batch_id), status="in_progress",
                request_counts={"total": 5, "completed": 0, "failed": 0})
    sync.update_batch(body)
    earlier = {"id": "batch_req_x", "custom_id": "c1", "error": None,
               "response": {"status_code": 200, "request_id": "r", "body": {}}}
    for line in (2, 4):  # finished before a restart
        assert sync.put_batch_result(batch_id, BatchResult(line, False, earlier))
    assert not sync.put_batch_result(batch_id, BatchResult(2, False, {}))  # written once

    async def main():
        store, engine, endpoint = AsyncStore(f"sqlite:///{path}"), FakeEngine(), Endpoint()
        endpoint.release.set()
        runner = _runner(store, endpoint, engine)
        task = asyncio.ensure_future(runner.run())
        await _until(lambda: runner._jobs, "claimed")
        await _until(lambda: batch_id not in runner._jobs, "finished")
        await runner.stop()
        task.cancel()
        await store.close()
        return endpoint

    endpoint = asyncio.run(main())
    assert sorted(t for t, _ in endpoint.calls) == ["t0", "t2", "t4"]  # lines 1, 3, 5
    final = sync.get_batch(batch_id)
    assert final["status"] == "completed" and final["request_counts"]["completed"] == 5
    output = sync.file_content(final["output_file_id"]).decode().splitlines()
    assert json.loads(output[1]) == earlier and json.loads(output[3]) == earlier


def test_a_draining_server_records_no_aborted_line_and_hands_the_batch_back(tmp_path):
    path = tmp_path / "s.sqlite3"
    batch_id = _batch(SQLiteStateStore(path), 5)

    async def main():
        store, engine = AsyncStore(f"sqlite:///{path}"), FakeEngine()
        endpoint = Endpoint({"t0": ["abort"], "t1": [200]})  # one cut short, one finished
        drain = {"on": False}
        runner = _runner(store, endpoint, engine, draining=lambda: drain["on"])
        task = asyncio.ensure_future(runner.run())
        await _until(lambda: len(endpoint.calls) == 2, "two lines in")
        drain["on"] = True
        endpoint.release.set()
        await _until(lambda: batch_id not in runner._jobs, "handed back")
        await runner.stop()
        task.cancel()
        results = await store.call("batch_results", batch_id)
        other = await store.call("claim_batch", "replica-2", 30.0)  # at once: released
        await store.close()
        return endpoint, results, other

    endpoint, results, other = asyncio.run(main())
    assert [t for t, _ in endpoint.calls] == ["t0", "t1"]  # nothing submitted while draining
    assert [r.line for r in results] == [2]  # the finished line only
    assert other["id"] == batch_id and other["status"] == "in_progress"


class BusyEngine:
    """An engine whose queue never empties: interactive requests always wait. Each look at
    the queue moves the test's clock on by `step_s` (the runner polls it every pace_s), so
    time passes exactly as the runner waits."""

    def __init__(self, clock: list[float], step_s: float):
        self.clock, self.step_s, self.is_busy = clock, step_s, True

    @property
    def num_waiting(self) -> int:
        self.clock[0] += self.step_s
        return 1 if self.is_busy else 0


class TimedEndpoint:
    """Each line takes `line_s` on the test's clock; records when each started."""

    def __init__(self, clock: list[float], line_s: float):
        self.clock, self.line_s, self.starts = clock, line_s, []

    async def __call__(self, request):
        await request.json()
        self.starts.append(self.clock[0])
        self.clock[0] += self.line_s
        return JSONResponse({"id": "chatcmpl-x", "usage": {"prompt_tokens": 1,
                                                          "completion_tokens": 1}})


def _paced(tmp_path, num_lines: int, window_s: float, step_s: float, until) -> tuple:
    path = tmp_path / "s.sqlite3"
    sync = SQLiteStateStore(path)
    batch_id = _batch(sync, num_lines)
    clock = [1_000_000.0]
    sync.update_batch(dict(sync.get_batch(batch_id), expires_at=clock[0] + window_s))
    engine, endpoint = BusyEngine(clock, step_s), TimedEndpoint(clock, 1.0)

    async def main():
        store = AsyncStore(f"sqlite:///{path}")
        limits = BatchLimits(max_inflight=2, poll_s=0.01, pace_s=0.002, heartbeat_s=0.05,
                             prior_line_s=1.0, pace_margin=2.0)
        runner = BatchRunner({URL: endpoint}, store.call, engine, "batch", "m", limits,
                             clock=lambda: clock[0])
        task = asyncio.ensure_future(runner.run())
        await _until(lambda: runner._jobs, "claimed")
        await until(runner, engine, endpoint)
        await _until(lambda: batch_id not in runner._jobs, "finished")
        await runner.stop()
        task.cancel()
        await store.close()

    asyncio.run(main())
    return sync.get_batch(batch_id), endpoint, clock[0]


def test_a_batch_under_a_queue_that_never_empties_meets_its_window(tmp_path):
    async def until(runner, engine, endpoint):
        pass

    body, endpoint, t0 = _paced(tmp_path, 6, 20.0, 0.05, until)
    start = body["expires_at"] - 20.0
    assert body["status"] == "completed" and body["request_counts"]["completed"] == 6
    assert body["completed_at"] < body["expires_at"]
    # It waited while it had slack: one seat is owed once 2 x 6 lines x 1 s >= the time
    # left, 8 s into its 20 s window, and each next line when the share reaches a seat again
    assert endpoint.starts[0] >= start + 8.0 - 0.1
    assert endpoint.starts == sorted(endpoint.starts)
    assert all(b - a >= 1.0 for a, b in zip(endpoint.starts, endpoint.starts[1:]))


def test_a_batch_with_slack_yields_to_a_busy_queue(tmp_path):
    async def until(runner, engine, endpoint):
        await _until(lambda: engine.clock[0] >= 1_000_000.0 + 3600, "an hour passed")
        assert endpoint.starts == []  # a 24 h window: nothing owed ahead of the queue
        (job,) = runner._jobs.values()
        assert runner._owed(job, engine.clock[0]) == 0
        engine.is_busy = False  # the queue empties: idle capacity runs it

    body, endpoint, _ = _paced(tmp_path, 4, 86400.0, 60.0, until)
    assert body["status"] == "completed" and len(endpoint.starts) == 4
    assert endpoint.starts[0] >= 1_000_000.0 + 3600


def test_the_pacer_owes_seats_as_the_deadline_nears():
    from servelm.server.batch_pacer import BatchPacer

    pacer = BatchPacer(prior_line_s=10.0)
    assert pacer.owed_seats(100, 86400, 8) == 0  # 2 x 100 x 10 s < a day: slack
    owed = [pacer.owed_seats(100, t, 8) for t in (2000, 1000, 500, 250, 100)]
    assert owed == [1, 2, 4, 8, 8]  # capped at the runner's seats
    assert pacer.owed_seats(0, 1, 8) == 0 and pacer.owed_seats(5, 0, 8) == 8
    pacer.observe(1.0)  # a measurement replaces the prior
    assert pacer.owed_seats(100, 200, 8) == 1
    pacer.observe(2.0)
    assert 1.0 < pacer.line_s < 2.0
