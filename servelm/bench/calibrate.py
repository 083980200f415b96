"""`servelm bench calibrate MODEL`: measure engine steps of known shape, fit a StepCostModel.

Owns: the calibration workloads (decode batches at several sizes and contexts, prefill
chunks of several lengths, and the mixed steps between them), timing each whole engine step
(schedule + runner + update: what a simulated step stands for), and the fit's report.
Never: guesses a coefficient: every figure comes from a step measured on this machine.

The model file feeds `servelm sim --cost-model FILE`; its `fit.engine` block records the
engine the steps ran on (KV blocks, limits), which the simulator takes as its replica.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from servelm.sim.cost_model import StepCostModel, StepShape, fit_cost_model, step_shape

# (number of requests, prompt tokens, new tokens): decode batches and prefill chunks.
DEFAULT_PLAN = [(1, 16, 48), (1, 1024, 8), (4, 128, 48), (8, 512, 32), (16, 64, 48),
                (32, 256, 24), (64, 96, 24), (2, 1536, 1), (6, 300, 1)]


class _Recorder:
    """Wraps a runner: remembers the shape of the step it was last given."""

    def __init__(self, inner):
        self.inner = inner
        self.last_shape: StepShape | None = None

    def execute(self, step):
        self.last_shape = step_shape(step)
        return self.inner.execute(step)


def measure_steps(engine, plan=DEFAULT_PLAN, seed: int = 0,
                  progress: bool = True) -> tuple[list[StepShape], list[float]]:
    """Run each (n, prompt, new) group through `engine` alone; every step's shape and wall
    seconds. The first group's steps also warm the engine up and are dropped."""
    import random

    from servelm.protocol import EngineRequest, SamplingParams

    rng = random.Random(seed)
    recorder = _Recorder(engine.runner)
    engine.runner = recorder
    shapes, seconds = [], []
    vocab = engine.vocab_size
    try:
        for g, (n, prompt_len, new) in enumerate([plan[0], *plan]):
            for i in range(n):
                ids = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
                engine.add_request(EngineRequest(f"cal{g}-{i}", ids, SamplingParams(
                    max_tokens=new, temperature=0, ignore_eos=True)))
            while engine.has_unfinished:
                recorder.last_shape = None
                start = time.perf_counter()
                engine.step()
                took = time.perf_counter() - start
                if recorder.last_shape is not None and g > 0:
                    shapes.append(recorder.last_shape)
                    seconds.append(took)
            if progress:
                print(f"[calibrate] {n} x {prompt_len} + {new}: {len(shapes)} steps so far",
                      file=sys.stderr)
    finally:
        engine.runner = recorder.inner
    return shapes, seconds


def calibrate(engine, name: str, plan=DEFAULT_PLAN, progress: bool = True) -> StepCostModel:
    from servelm.bench.results import git_commit, machine_info

    shapes, seconds = measure_steps(engine, plan, progress=progress)
    model = fit_cost_model(name, shapes, seconds)
    bm, sched = engine.block_manager, engine.scheduler.config
    model.fit.update({
        "machine": machine_info(), "commit": git_commit(), "plan": [list(p) for p in plan],
        "engine": {"num_blocks": bm.num_blocks, "block_size": bm.block_size,
                   "max_num_seqs": sched.max_num_seqs,
                   "max_num_batched_tokens": sched.max_num_batched_tokens,
                   "enable_chunked_prefill": sched.enable_chunked_prefill,
                   "enable_prefix_caching": bm.prefix_cache is not None,
                   "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                   "eos_token_ids": sorted(engine.eos_token_ids)},
    })
    return model


def cmd_calibrate(args: argparse.Namespace) -> int:
    from servelm.config import engine_args_from_cli
    from servelm.engine_builder import build_engine

    engine = build_engine(engine_args_from_cli(args))
    name = args.name or f"{engine.model_name}-{engine.engine_args.dtype}"
    model = calibrate(engine, name, progress=not args.no_progress)
    out = Path(args.out) if args.out else Path("benchmarks/results") / f"cost-model-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    fit = model.fit
    print(json.dumps({k: getattr(model, k) for k in
                      ("base_s", "per_seq_s", "per_decode_token_s", "per_decode_context_s",
                       "per_prefill_token_s", "per_prefill_pair_s")}, indent=2))
    print(f"[calibrate] {fit['num_samples']} steps; mean |error| "
          f"{fit['mean_abs_rel_error']:.1%}, p90 {fit['p90_abs_rel_error']:.1%}; wrote {out}",
          file=sys.stderr)
    return 0


def add_parser(bench_sub) -> argparse.ArgumentParser:
    from servelm.config import add_engine_cli_args
    from servelm.loader.model_cache import DEFAULT_MODEL

    p = bench_sub.add_parser("calibrate", help="fit a step-cost model for `servelm sim` from "
                             "steps measured on this machine",
                             description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--name", default=None, help="the model's name (default: MODEL-DTYPE)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/cost-model-NAME.json)")
    p.add_argument("--no-progress", action="store_true")
    add_engine_cli_args(p)
    p.set_defaults(func=cmd_calibrate)
    return p
