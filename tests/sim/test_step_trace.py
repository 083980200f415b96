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
from servelm.sim.cost_model import StepCostModel, StepShape
from servelm.sim.runner import SimRunner, VirtualClock
from servelm.sim.step_trace import StepTrace, read_step_trace

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
    engine_block, shapes, seconds, admit_s = read_step_trace(path)
    assert len(admit_s) == len(reqs) and all(0 <= a < 20 for a in admit_s)
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
    lines = [{"kind": "step-trace", "engine": engine}]
    lines += [{"t": i, "s": s, "shape": list(shape)} for i, (shape, s) in enumerate(rows)]
    lines += [{"admit_s": a} for a in admit]
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
    _write_trace(tmp_path / "a.jsonl", engine, warmup + rows[:10], admit=[0.001, 0.003])
    _write_trace(tmp_path / "b.jsonl", engine, warmup + rows[10:], admit=[0.002, 0.5])
    model = calibrate_served([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], "m")
    assert model.fit["source"] == "served" and model.fit["engine"] == engine
    assert model.fit["num_samples"] == len(rows)
    assert model.fit["mean_abs_rel_error"] < 1e-6
    assert model.base_s == pytest.approx(truth.base_s, rel=1e-4)
    assert model.per_decode_token_s == pytest.approx(truth.per_decode_token_s, rel=1e-4)
    # the front end's per-request part: the median admission lag (a stalled one is ignored)
    assert model.arrival_s == pytest.approx(0.0025)
    assert model.fit["admit_s"]["n"] == 4


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
