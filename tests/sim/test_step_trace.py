"""The served-step trace: the engine loop writes one line per step it ran (shape and wall time,
start to next start), and `servelm bench calibrate --served-steps` fits a StepCostModel to it.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from servelm.bench.calibrate import calibrate_served
from servelm.config import SchedulerConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.engine import Engine
from servelm.engine.engine_loop import EngineLoop
from servelm.protocol import EngineRequest, SamplingParams
from servelm.engine.step_cost_model import StepCostModel, StepShape
from servelm.sim.runner import SimRunner, VirtualClock
from servelm.engine.step_trace import Admission, StepTrace, read_step_trace

COST = StepCostModel("t", base_s=0.002, per_decode_token_s=0.0003, per_prefill_token_s=2e-5)


class _Sink:
    def __init__(self):
        self.done = threading.Event()
        self.finished: set[str] = set()

    def admitted(self, *a): pass
    def rejected(self, *a): pass
    def dead(self, exc): raise AssertionError(exc)
    def stopped(self): self.done.set()
    def lora_done(self, *a): pass

    def outputs(self, deltas, report, kv_events):
        self.finished |= {d.request_id for d in deltas if d.timings is not None}


def _engine(trace_path) -> Engine:
    runner = SimRunner(COST, VirtualClock(), 1000, (0,))
    engine = Engine(runner, None, BlockManager(64, 16, False), SchedulerConfig(64, 8, True),
                    512, 1000, (0,))
    engine.engine_args = SimpleNamespace(step_trace=str(trace_path))
    return engine


def test_engine_loop_writes_every_step(tmp_path):
    path = tmp_path / "steps.jsonl"
    engine = _engine(path)
    sink = _Sink()
    loop = EngineLoop(engine, sink)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    reqs = [EngineRequest(f"r{i}", list(range(100, 100 + 40 + 30 * i)),
                          SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True),
                          arrival_time=time.monotonic())  # as the HTTP handler stamps it
            for i in range(4)]
    loop.add(reqs)
    deadline = time.monotonic() + 20
    while len(sink.finished) < len(reqs) and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    assert sink.done.wait(20)
    engine_block, shapes, seconds, admissions = read_step_trace(path)
    assert len(admissions) == len(reqs) and all(0 <= a.lag_s < 20 for a in admissions)
    # added together to an idle loop: taken in the one wake-up, before any step
    assert all(a.is_idle for a in admissions)
    assert engine_block["num_blocks"] == 64 and engine_block["max_num_seqs"] == 8
    # every step the engine ran is in the trace, with its shape
    assert len(shapes) == engine.stats.num_steps > 4
    assert sum(s.num_decode_tokens for s in shapes) + len(reqs) == engine.stats.num_generated_tokens
    assert sum(s.num_prefill_tokens for s in shapes) == sum(len(r.prompt_token_ids) for r in reqs)
    assert all(s > 0 for s in seconds)


def test_step_runs_start_to_next_start_and_ends_at_idle(tmp_path):
    now = [0.0]
    engine = _engine(tmp_path / "unused.jsonl")
    engine.last_step_description = None
    path = tmp_path / "steps.jsonl"
    trace = StepTrace(path, engine, clock=lambda: now[0])
    from servelm.core.contract import StepDescription

    for start, shape_seqs in ((1.0, 1), (1.5, 2), (4.0, 3)):
        now[0] = start
        trace.begin()
        engine.last_step_description = StepDescription(0, [], [], [], [])
        trace.stepped(engine)
        if start == 1.5:
            now[0] = 2.25  # the loop went idle 0.75 s after this step began
            trace.idle()
    now[0] = 4.5
    trace.close()
    _, shapes, seconds, _ = read_step_trace(path)
    assert seconds == [0.5, 0.75, 0.5]
    assert shapes == [StepShape(0, 0, 0, 0, 0)] * 3


def _write_trace(path, engine, rows, admit=()) -> None:
    """admit: (lag, idle) pairs, written after the steps."""
    lines = [{"kind": "step-trace", "engine": engine}]
    lines += [{"t": i, "s": s, "shape": list(shape)} for i, (shape, s) in enumerate(rows)]
    lines += [{"admit_s": a, "idle": idle} for a, idle in admit]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_calibrate_served_recovers_the_model_behind_the_steps(tmp_path):
    truth = StepCostModel("truth", base_s=0.004, per_seq_s=0.0002, per_decode_token_s=0.0005,
                          per_decode_context_s=2e-6, per_prefill_token_s=6e-5,
                          per_prefill_pair_s=3e-9)
    shapes = [StepShape(n, n, n * ctx, 0, 0) for n in (1, 4, 16, 32) for ctx in (50, 400)]
    shapes += [StepShape(k + d, d, d * 100, p, p * p // 2 // k) for d in (0, 8)
               for p in (64, 512) for k in (1, 3)]  # k prefill chunks in one step
    rows = [(s, truth.predict(s)) for s in shapes]
    warmup = [(StepShape(1, 1, 10, 0, 0), 5.0)] * 8  # dropped: the first 8 steps of a file
    engine = {"num_blocks": 100, "block_size": 16}
    _write_trace(tmp_path / "a.jsonl", engine, warmup + rows[:10],
                 admit=[(0.001, True), (0.003, True)])
    _write_trace(tmp_path / "b.jsonl", engine, warmup + rows[10:],
                 admit=[(0.002, True), (0.5, True)])
    model = calibrate_served([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], "m")
    assert model.fit["source"] == "served" and model.fit["engine"] == engine
    assert model.fit["num_samples"] == len(rows)
    assert model.fit["mean_abs_rel_error"] < 1e-6
    assert model.base_s == pytest.approx(truth.base_s, rel=1e-4)
    assert model.per_decode_token_s == pytest.approx(truth.per_decode_token_s, rel=1e-4)
    # the front end's per-request part: the median admission lag (a stalled one is ignored)
    assert model.arrival_s == pytest.approx(0.0025)
    assert model.fit["admit_s"]["n"] == model.fit["admit_s"]["n_idle"] == 4


def test_sim_admits_each_request_arrival_s_after_it_was_sent():
    import dataclasses

    from servelm.router.policies import make_policy
    from servelm.sim.fleet import ReplicaSpec, SimRequest, simulate

    reqs = [SimRequest(0.1 * i, list(range(100, 160 + 7 * i)), 5) for i in range(6)]
    spec = ReplicaSpec(num_blocks=64, vocab_size=1000)
    base = simulate(reqs, 1, spec, COST, make_policy("round_robin"))
    lagged = simulate(reqs, 1, spec, dataclasses.replace(COST, arrival_s=0.03),
                      make_policy("round_robin"))
    for a, b in zip(sorted(base.records, key=lambda r: r.sent_time),
                    sorted(lagged.records, key=lambda r: r.sent_time)):
        assert a.sent_time == b.sent_time  # the client's clock
        # requests far apart: each starts on an idle replica, 30 ms later
        assert b.first_token_time - a.first_token_time == pytest.approx(0.03)
        assert b.num_output_tokens == a.num_output_tokens == 5


def test_calibrate_served_refuses_bad_input(tmp_path):
    _write_trace(tmp_path / "a.jsonl", {"num_blocks": 1}, [])
    _write_trace(tmp_path / "b.jsonl", {"num_blocks": 2}, [])
    with pytest.raises(ValueError, match="another engine"):
        calibrate_served([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], "m")
    (tmp_path / "c.jsonl").write_text('{"kind": "step-cost-model"}\n')
    with pytest.raises(ValueError, match="not a step trace"):
        calibrate_served([str(tmp_path / "c.jsonl")], "m")
    with pytest.raises(ValueError, match="skip_steps"):
        calibrate_served([str(tmp_path / "a.jsonl")], "m", skip_steps=-1)


class _HeldRunner(SimRunner):
    """A SimRunner whose first step waits until the test lets it end."""

    def __init__(self):
        super().__init__(COST, VirtualClock(), 1000, (0,))
        self.entered, self.release = threading.Event(), threading.Event()

    def execute(self, step):
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(20)
        return super().execute(step)


def test_a_request_that_arrives_during_a_step_is_admitted_busy_after_it(tmp_path):
    path = tmp_path / "steps.jsonl"
    runner = _HeldRunner()
    engine = Engine(runner, None, BlockManager(64, 16, False), SchedulerConfig(64, 8, True),
                    512, 1000, (0,))
    engine.engine_args = SimpleNamespace(step_trace=str(path))
    sink = _Sink()
    loop = EngineLoop(engine, sink)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()

    def request(i):
        return EngineRequest(f"r{i}", list(range(100, 140)), SamplingParams(
            max_tokens=3, temperature=0, ignore_eos=True), arrival_time=time.monotonic())

    loop.add([request(0)])  # wakes the idle loop, whose first step then holds
    assert runner.entered.wait(20)
    loop.add([request(1)])  # arrives while that step runs
    time.sleep(0.05)
    runner.release.set()
    deadline = time.monotonic() + 20
    while len(sink.finished) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    assert sink.done.wait(20)
    _, _, _, (first, second) = read_step_trace(path)
    assert first.is_idle and not second.is_idle
    assert second.lag_s >= 0.05  # it waited for the step to end: the simulator's own wait
    rows = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert [r["idle"] for r in rows if "admit_s" in r] == [True, False]
    assert all(isinstance(r["t"], float) for r in rows)


def test_idle_flag_follows_the_step_in_progress():
    """admitted() between a step's Engine.step and the next begin() is busy; after idle()
    (the loop waits for work) and before the first step it is idle."""
    import io

    from servelm.core.contract import StepDescription

    now = [10.0]
    trace = StepTrace.__new__(StepTrace)
    trace.clock = lambda: now[0]
    trace._file = io.StringIO()
    trace._start = trace._pending = None
    trace._unflushed = trace.num_steps = 0
    engine = SimpleNamespace(last_step_description=StepDescription(0, [], [], [], []))
    req = SimpleNamespace(arrival_time=9.99)
    trace.admitted(req)
    trace.begin()
    trace.stepped(engine)
    now[0] = 10.2
    trace.admitted(req)
    trace.idle()
    now[0] = 11.0
    trace.admitted(req)
    rows = [json.loads(x) for x in trace._file.getvalue().splitlines()]
    admits = [r for r in rows if "admit_s" in r]
    assert [a["idle"] for a in admits] == [True, False, True]
    assert [a["admit_s"] for a in admits] == pytest.approx([0.01, 0.21, 1.01])


def test_older_traces_have_the_idle_flag_inferred_from_line_order(tmp_path):
    """Before the flag, the order tells: a step's line is written when it ends (at the next
    begin() or at idle()), admissions between two steps' lines."""
    step = lambda t, s: {"t": t, "s": s, "shape": [1, 1, 10, 0, 0]}  # noqa: E731
    rows = [
        {"admit_s": 0.002},   # the first request woke the loop
        {"admit_s": 0.150},   # arrived during step 0, taken at its end
        step(100.0, 0.2),     # step 0 (written at step 1's begin)
        {"admit_s": 0.030},   # during step 1, back to back with step 0
        step(100.2, 0.03),    # step 1 ...
        step(100.23, 0.03),   # ... ended at idle(): step 3 starts 1.77 s later
        {"admit_s": 0.001},   # woke the loop
        {"admit_s": 0.090},   # arrived during step 3
        step(102.0, 0.1),     # step 3
        step(102.1, 0.03),
    ]
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in
                            [{"kind": "step-trace", "engine": {}}] + rows))
    _, shapes, seconds, admissions = read_step_trace(path)
    assert admissions == [Admission(0.002, True), Admission(0.150, False),
                          Admission(0.030, False), Admission(0.001, True),
                          Admission(0.090, False)]
    assert len(shapes) == len(seconds) == 5


def test_arrival_s_is_the_front_ends_lag_not_the_wait_for_a_step(tmp_path):
    """A request taken by a busy loop waited for the running step to end, which the
    simulator models itself; arrival_s comes from the idle loop's admissions (the median),
    or with none of those from the smallest lag."""
    rows = [(StepShape(n, n, 100 * n, 0, 0), 0.03 + 0.001 * n) for n in range(1, 11)] * 2
    admit = [(0.0015, True), (0.0021, True), (0.0012, True), (0.160, False),
             (0.022, False), (0.013, False), (0.250, False), (0.031, False), (0.004, False)]
    engine = {"num_blocks": 100}
    _write_trace(tmp_path / "a.jsonl", engine, rows, admit=admit)
    model = calibrate_served([str(tmp_path / "a.jsonl")], "m", skip_steps=0)
    assert model.arrival_s == pytest.approx(0.0015)  # the median of all nine is 13 ms
    rep = model.fit["admit_s"]
    assert rep["n"] == 9 and rep["n_idle"] == 3 and rep["p50"] == pytest.approx(0.013)
    _write_trace(tmp_path / "b.jsonl", engine, rows, admit=[a for a in admit if not a[1]])
    model = calibrate_served([str(tmp_path / "b.jsonl")], "m", skip_steps=0)
    assert model.arrival_s == pytest.approx(0.004)
    assert model.fit["admit_s"]["n_idle"] == 0 and model.fit["admit_s"]["p50_idle"] is None


def test_the_sim_already_holds_the_wait_for_a_running_step():
    """Why arrival_s leaves the wait out: a simulated request that arrives during a step
    waits for its end, as on the server. Request 1 arrives 10 ms into request 0's 210 ms
    prefill; on the server its admission lag is 200 ms (taken at the step's end). The
    simulator with arrival_s 0 already serves it after that wait; with the 200 ms as
    arrival_s (every admission's lag, as calibration took it before) it waits twice."""
    import dataclasses

    from servelm.router.policies import make_policy
    from servelm.sim.fleet import ReplicaSpec, SimRequest, simulate

    cost = StepCostModel("p", base_s=0.01, per_prefill_token_s=0.001)
    reqs = [SimRequest(0.0, list(range(100, 300)), 2), SimRequest(0.01, list(range(400, 500)), 2)]
    spec = ReplicaSpec(num_blocks=64, vocab_size=1000, max_num_batched_tokens=512)

    def ttfts(c):
        res = simulate(reqs, 1, spec, c, make_policy("round_robin"))
        return [r.first_token_time - r.sent_time
                for r in sorted(res.records, key=lambda r: r.sent_time)]

    # request 0's prefill: 0.01 + 0.2 s; request 1's, after it: 0.01 + 0.1 s
    assert ttfts(cost) == pytest.approx([0.21, 0.2 + 0.11])
    assert ttfts(dataclasses.replace(cost, arrival_s=0.2)) == pytest.approx([0.41, 0.51])
