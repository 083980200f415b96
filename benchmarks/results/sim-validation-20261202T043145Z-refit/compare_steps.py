"""The measured runs' served steps against the simulated ones, per run, for the record's
model and the earlier record's (linear) model: the prefill-bearing steps in order (shape,
measured ms, simulated ms), and per run each step class's total predicted / measured.

    .venv/bin/python RECORD/compare_steps.py SRC RECORD > RECORD/step-sequence.md
"""

import json
import sys
from datetime import datetime
from pathlib import Path

from servelm.router.policies import make_policy
from servelm.sim.arrivals import read_trace, trace_prompts
from servelm.sim.cli import replica_spec
from servelm.sim.cost_model import STEP_CLASSES, StepCostModel, StepShape, step_class
from servelm.sim.fleet import SimRequest, simulate

src, out = Path(sys.argv[1]), Path(sys.argv[2])
models = {"linear (earlier record)": StepCostModel.load(src / "cost-model.json"),
          "roofline (this record)": StepCostModel.load(out / "cost-model.json")}


class _NoOverrides:
    num_blocks = block_size = max_num_seqs = max_num_batched_tokens = max_model_len = None
    no_prefix_cache = False
    vocab_size = 49152


class _Log:
    """A cost model that remembers every step shape it was asked for, in order."""

    def __init__(self, inner):
        self.inner, self.name, self.fit = inner, inner.name, inner.fit
        self.arrival_s, self.shapes = inner.arrival_s, []

    def predict(self, shape):
        self.shapes.append(tuple(shape))
        return self.inner.predict(shape)

    def step_time(self, *shape):
        return self.predict(StepShape(*shape))


rows = [json.loads(line) for line in (src / "measure-steps-015852.jsonl").open()][1:]
steps = [r for r in rows if "s" in r]
for name in ("light", "knee", "overload"):
    serve = json.loads((src / f"serve-{name}.json").read_text())
    t0 = datetime.fromisoformat(serve["started_at"].replace("Z", "+00:00")).timestamp()
    # The run's first step is its first prompt (445 tokens) alone, the first after
    # started_at (whole seconds; the warm-up requests come before it); the run lasts
    # elapsed_s from its first request's send.
    first = next(i for i, s in enumerate(steps) if s["t"] >= t0 - 1 and s["shape"][3] == 445)
    window = [s for s in steps[first:] if s["t"] < steps[first]["t"] + serve["elapsed_s"]]
    print(f"## {name} ({serve['load']['request_rate']:g} req/s): {len(window)} measured steps "
          f"from the run's first prompt to its end\n")
    print("Total predicted / measured over the run's measured steps, by class:\n")
    print("| model | " + " | ".join(STEP_CLASSES) + " | all |")
    print("|---|" + "---|" * (len(STEP_CLASSES) + 1))
    for label, m in models.items():
        cells = []
        for kind in (*STEP_CLASSES, None):
            sel = [s for s in window if kind is None or step_class(StepShape(*s["shape"])) == kind]
            if not sel:
                cells.append("-")
                continue
            pred = sum(m.predict(StepShape(*s["shape"])) for s in sel)
            cells.append(f"{pred / sum(s['s'] for s in sel):.3f} ({len(sel)})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    spec = replica_spec(_NoOverrides(), models["roofline (this record)"])
    trace = read_trace(src / f"trace-{name}.jsonl")
    prompts = trace_prompts(trace, spec.vocab_size)
    reqs = [SimRequest(t.arrival_s, p, t.num_replay_tokens) for t, p in zip(trace, prompts)]
    logs = {}
    for label, m in models.items():
        logs[label] = _Log(m)
        simulate(reqs, 1, spec, logs[label], make_policy("round_robin"))
    print("\nThe prefill-bearing steps in order: measured (its time, and what each model "
          "predicts for that shape) and simulated with each model (shape, predicted time):\n")
    print("| # | measured shape [seqs, decodes, ctx, prefill, pairs] | measured ms | linear "
          "| roofline | simulated, linear | simulated, roofline |")
    print("|---|---|---|---|---|---|---|")
    meas = [s for s in window if s["shape"][3] > 0]
    sims = {k: [s for s in v.shapes if s[3] > 0] for k, v in logs.items()}
    lin, roof = models.values()
    for i in range(max(len(meas), *(len(v) for v in sims.values()))):
        cells = [str(i + 1)]
        if i < len(meas):
            sh = StepShape(*meas[i]["shape"])
            cells += [str(list(sh)), f"{1e3 * meas[i]['s']:.0f}",
                      f"{1e3 * lin.predict(sh):.0f}", f"{1e3 * roof.predict(sh):.0f}"]
        else:
            cells += ["", "", "", ""]
        for (label, v), m in zip(sims.items(), (lin, roof)):
            cells.append(f"{list(v[i])} {1e3 * m.predict(StepShape(*v[i])):.0f}"
                         if i < len(v) else "")
        print("| " + " | ".join(cells) + " |")
    print()
    for label, v in logs.items():
        print(f"Simulated with the {label} model: {len(v.shapes)} steps, "
              f"{sum(1 for s in v.shapes if s[3] > 0)} with a prefill chunk.  ")
    print(f"Measured: {len(window)} steps, {len(meas)} with a prefill chunk.\n")
