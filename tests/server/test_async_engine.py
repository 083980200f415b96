"""AsyncEngine and SSEResponse without a model: a fake runner makes tokens."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from fake_runner import FakeRunner
from fake_runner import make_engine as fake_engine

from servelm.engine.async_engine import AsyncEngine, EngineDeadError
from servelm.protocol import EngineRequest, FinishReason, InvalidParameterError, SamplingParams
from servelm.server.sse import SSEResponse


def make_engine(step_s: float = 0.002, fail_after: int | None = None):
    runner = FakeRunner(vocab_size=57, step_s=step_s, fail_after=fail_after)
    return fake_engine(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                       max_model_len=256, runner=runner), runner


def req(rid, max_tokens=5, n=1, prompt=(3, 4, 5)):
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, n=n,
                                                           ignore_eos=True, temperature=0))


def run(coro):
    return asyncio.run(coro)


def test_generate_streams_to_the_end_and_the_thread_sleeps_when_idle():
    engine, runner = make_engine()

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        tokens, last = [], None
        async for d in ae.generate(req("a", max_tokens=6)):
            tokens += d.token_ids
            last = d
        steps = runner.num_steps
        await asyncio.sleep(0.3)
        idle_steps = runner.num_steps - steps
        ae.stop()
        return tokens, last, idle_steps

    tokens, last, idle_steps = run(main())
    assert len(tokens) == 6 and last.finish_reason == FinishReason.LENGTH
    assert last.timings is not None
    assert idle_steps == 0
    assert engine.block_manager.num_free_blocks == 64


def test_engine_rejection_reaches_the_caller():
    engine, _ = make_engine()

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            with pytest.raises(InvalidParameterError) as exc:
                async for _ in ae.generate(req("a", prompt=[1, 2, 5000])):
                    pass
            # and the next request is fine
            out = [d async for d in ae.generate(req("b", max_tokens=2))]
        finally:
            ae.stop()
        return exc.value, out

    err, out = run(main())
    assert err.param == "prompt"
    assert sum(len(d.token_ids) for d in out) == 2


def test_abort_from_another_thread_frees_blocks_within_a_step():
    engine, _ = make_engine(step_s=0.01)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        stream = ae.submit([req("long", max_tokens=200)])
        await stream.admitted
        await stream.get()  # it runs
        threading.Thread(target=ae.abort, args=("long",)).start()
        reasons = []
        while True:
            deltas = await stream.get()
            if not deltas:
                break
            reasons += [d.finish_reason for d in deltas if d.finish_reason]
        await asyncio.sleep(0.05)
        ae.stop()
        return reasons

    assert run(main()) == [FinishReason.ABORT]
    assert engine.block_manager.num_free_blocks == 64


def test_slow_reader_gets_coalesced_deltas_not_a_growing_queue():
    engine, _ = make_engine(step_s=0.001)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        stream = ae.submit([req("r", max_tokens=40, n=2)])
        await stream.admitted
        while not stream.is_finished:  # the reader sleeps while the engine runs
            await asyncio.sleep(0.05)
            assert len(stream._pending) <= 2  # one merged delta per choice, at most
        deltas = await stream.get()
        ae.stop()
        return deltas

    deltas = run(main())
    assert sorted(len(d.token_ids) for d in deltas) == [40, 40]
    assert all(d.finish_reason == FinishReason.LENGTH for d in deltas)


def test_engine_crash_fails_requests_and_marks_dead():
    engine, _ = make_engine(fail_after=2)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        with pytest.raises(EngineDeadError):
            async for _ in ae.generate(req("a", max_tokens=50)):
                pass
        await asyncio.sleep(0.05)
        return ae.is_alive

    assert run(main()) is False


class _HoldingRunner(FakeRunner):
    """A FakeRunner that, from step `hold_at` on, waits for `release` before each step: the
    request it serves cannot finish before the test says so."""

    def __init__(self, hold_at: int, **kwargs):
        super().__init__(**kwargs)
        self.hold_at = hold_at
        self.release = threading.Event()

    def execute(self, step):
        if self.num_steps + 1 >= self.hold_at:
            self.release.wait(60)
        return super().execute(step)


def test_stalled_sse_reader_is_dropped_after_the_write_timeout():
    """The stalled reader is dropped by the write timeout while its request still runs (the
    engine is held before the request's last steps until the drop), and the drop aborts the
    request: it cannot have been its end that closed the stream."""
    max_tokens = 200
    runner = _HoldingRunner(hold_at=max_tokens - 20, vocab_size=57, step_s=0.005)
    engine = fake_engine(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                         max_model_len=256, runner=runner)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        stream = ae.submit([req("s", max_tokens=max_tokens)])
        await stream.admitted
        dropped, unfinished_at_drop = [], []

        async def events():
            while True:
                deltas = await stream.get()
                if not deltas:
                    return
                yield "data: x\n\n"

        def on_disconnect(why):
            dropped.append(why)
            unfinished_at_drop.append("s" in stream._unfinished)
            ae.release(stream)  # what the server does: abort the request
            runner.release.set()

        sent = []

        async def send(message):  # the client stops reading after the headers + 1 event
            sent.append(message)
            if len(sent) > 2:
                await asyncio.Event().wait()

        async def receive():
            await asyncio.Event().wait()

        response = SSEResponse(events(), write_timeout=0.2, on_disconnect=on_disconnect)
        await asyncio.wait_for(response({"type": "http"}, receive, send), 60)
        for _ in range(1000):  # the abort reaches the engine with its next command
            if not engine.has_unfinished:
                break
            await asyncio.sleep(0.01)
        ae.stop()
        return dropped, unfinished_at_drop

    dropped, unfinished_at_drop = run(main())
    assert dropped == ["write_timeout"]
    assert unfinished_at_drop == [True]
    assert engine.block_manager.num_free_blocks == 64
    assert not engine.has_unfinished
    assert runner.num_steps < max_tokens  # aborted: the last tokens were never made


def test_live_server_reports_an_engine_crash_mid_stream():
    from live_server import LiveServer

    engine, _ = make_engine(step_s=0.01, fail_after=4)
    server = LiveServer(engine)
    try:
        with server.client() as c:
            assert c.get("/health").status_code == 200
            body = {"prompt": [3, 4, 5], "max_tokens": 50, "ignore_eos": True, "stream": True}
            lines = [line for line in c.post("/v1/completions", json=body).text.splitlines()
                     if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2][len("data: "):])["error"]
            assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
            assert c.get("/health").status_code == 503
            r = c.post("/v1/completions", json={"prompt": [3], "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            assert server.metrics()["servelm_engine_alive"] == 0
    finally:
        server.stop()
