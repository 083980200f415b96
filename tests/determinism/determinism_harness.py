"""The determinism conformance harness: a fixed set of requests (greedy and seeded sampling),
run alone for the reference and then under perturbations of everything else the engine is
doing. In deterministic mode each request's token ids and logprobs must be bitwise those of
its reference; without it the harness measures how often they are not.

    reference        each case alone, prefix cache off, unchunked, one at a time
    perturbations    other requests arriving at random steps (batches of 1 to 64), random
                     chunk budgets, prefix cache warmed by other requests' prefills of the
                     cases' prefixes, a KV pool small enough to force preemption, n-gram
                     speculative decoding, one intra-op thread instead of two; for a
                     bfloat16 model, decode steps big enough to run in slices of rows

Each scenario also reports what it perturbed (largest batch, chunked prefills, prefix-hit
tokens, preemptions, accepted drafts), so a test asserts that the perturbation happened.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

import torch

from servelm.protocol import EngineRequest, SamplingParams


@dataclass(frozen=True)
class Case:
    name: str
    prompt: tuple[int, ...]
    params: SamplingParams


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    # per token: (token id, logprob, top alternatives) as floats, compared bitwise
    logprobs: list[tuple] = field(default_factory=list)

    def key(self):
        return self.token_ids, self.logprobs


def make_cases(vocab: int, num_greedy: int, num_sampled: int, max_tokens: int,
               seed: int = 0, lo: int = 5, hi: int = 70) -> list[Case]:
    """Greedy cases with top-2 logprobs, seeded sampling cases (temperature, top-p) with
    logprobs, and greedy cases without logprobs (speculation takes only those)."""
    rng = random.Random(seed)

    def prompt() -> tuple[int, ...]:
        n = rng.randint(lo, hi)
        if rng.random() < 0.5:  # a repeating pattern: the n-gram proposer finds drafts
            pattern = [rng.randrange(vocab) for _ in range(rng.randint(3, 6))]
            return tuple((pattern * n)[:n])
        return tuple(rng.randrange(vocab) for _ in range(n))

    cases = []
    for i in range(num_greedy):
        cases.append(Case(f"greedy{i}", prompt(), SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)))
        cases.append(Case(f"greedy-nolp{i}", prompt(), SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True)))
    for i in range(num_sampled):
        cases.append(Case(f"sampled{i}", prompt(), SamplingParams(
            max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=1000 + i,
            ignore_eos=True, logprobs=2)))
    return cases


def fillers(cases: list[Case], vocab: int, n: int, seed: int,
            share_prefix: bool = False) -> list[tuple[list[int], SamplingParams]]:
    """Other requests: random prompts and parameters (unseeded sampling draws from the
    engine's stream); with share_prefix, each starts with part of a case's prompt."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if share_prefix:
            base = cases[i % len(cases)].prompt
            prompt = list(base[:rng.randint(1, len(base))])
        else:
            prompt = []
        prompt += [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        kind = rng.random()
        if kind < 0.4:
            params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=0,
                                    ignore_eos=True)
        elif kind < 0.8:
            params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=1.0,
                                    ignore_eos=True, logprobs=rng.choice([None, 1]))
        else:
            params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.7, top_k=20,
                                    seed=rng.randrange(10**6), ignore_eos=True)
        out.append((prompt, params))
    return out


@dataclass
class Perturbed:
    """What a run did to the cases' surroundings."""

    max_batch: int = 0  # most sequences in one step
    chunked: int = 0  # steps that ran a prefill chunk alongside other sequences or split
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    spec_accepted: int = 0
    row_split_steps: int = 0  # decode steps the C++ stack ran in slices of rows (row_parts)


def run(engine, cases: list[Case], others=(), seed: int = 0,
        spread: int = 0) -> tuple[dict[str, Output], Perturbed]:
    """Run cases and other requests through `engine`; requests arrive at random steps in
    0..spread (all at step 0 when spread is 0), in a random order."""
    rng = random.Random(seed)
    items = [(c.name, list(c.prompt), c.params) for c in cases]
    items += [(f"other{i}", p, sp) for i, (p, sp) in enumerate(others)]
    rng.shuffle(items)
    arrivals = sorted(((rng.randint(0, spread) if spread else 0), i) for i in range(len(items)))
    outputs = {name: Output() for name, _, _ in items}
    perturbed = Perturbed()
    preempt0 = engine.scheduler.num_preemptions
    hits0 = _prefix_hits(engine)
    accepted0 = engine.stats.spec_num_accepted
    split0 = _split_steps(engine)
    step = 0
    pending = list(arrivals)
    while pending or engine.has_unfinished:
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            name, prompt, params = items[i]
            engine.add_request(EngineRequest(name, prompt, params))
        for d in engine.step():
            assert d.error is None, d.error
            out = outputs[d.request_id]
            out.token_ids += d.token_ids
            for lp in d.logprobs or []:
                out.logprobs.append((lp.token_id, lp.logprob, tuple(lp.top)))
        st = engine.stats
        perturbed.max_batch = max(perturbed.max_batch, st.last_num_seqs)
        if st.last_num_prefill_tokens and st.last_num_seqs > 1:
            perturbed.chunked += 1
        step += 1
    engine.check_invariants()
    perturbed.preemptions = engine.scheduler.num_preemptions - preempt0
    perturbed.prefix_hit_tokens = _prefix_hits(engine) - hits0
    perturbed.spec_accepted = engine.stats.spec_num_accepted - accepted0
    perturbed.row_split_steps = _split_steps(engine) - split0
    return {c.name: outputs[c.name] for c in cases}, perturbed


def _split_steps(engine) -> int:
    stack = getattr(engine.runner, "cpu_stack", None)
    return 0 if stack is None else stack.split_steps


def _prefix_hits(engine) -> int:
    """Prompt tokens admitted minus prompt tokens computed: those came from the cache (a
    preemption's recompute counts against it; only runs without preemption read it)."""
    st = engine.stats
    return st.num_prompt_tokens - st.num_computed_prompt_tokens


def reference(make_engine, cases: list[Case]) -> dict[str, Output]:
    """Each case alone: prefix cache off, a budget that takes its prompt in one chunk."""
    engine = make_engine(enable_prefix_caching=False, max_num_batched_tokens=4096)
    out = {}
    for case in cases:
        got, perturbed = run(engine, [case])
        assert perturbed.max_batch == 1
        out.update(got)
    return out


def diverged(ref: dict[str, Output], got: dict[str, Output]) -> dict[str, list[str]]:
    """{"tokens": case names whose ids differ, "logprobs": whose logprobs differ}."""
    return {"tokens": sorted(n for n in ref if ref[n].token_ids != got[n].token_ids),
            "logprobs": sorted(n for n in ref if ref[n].logprobs != got[n].logprobs)}


@dataclass
class Scenario:
    name: str
    engine_kwargs: dict
    num_others: int = 0
    spread: int = 0
    share_prefix: bool = False
    warm: bool = False  # run the others once first (their prefills fill the prefix cache)
    threads: int | None = None
    row_split: bool = False  # big all-decode steps must run in slices of rows


def scenarios(max_chunk: int = 64) -> list[Scenario]:
    """The perturbations of the suite, sized for a tiny model (block_size 4)."""
    return [
        Scenario("batch-4", {}, num_others=3, spread=3),
        Scenario("batch-16", {}, num_others=15, spread=10),
        Scenario("batch-64", {"max_num_seqs": 64}, num_others=63, spread=20),
        Scenario("chunk-7", {"max_num_batched_tokens": 7}, num_others=6, spread=5),
        Scenario(f"chunk-random", {"max_num_batched_tokens": random.Random(1).randint(9, max_chunk)},
                 num_others=10, spread=8),
        Scenario("prefix-warm", {}, num_others=12, share_prefix=True, warm=True),
        Scenario("preemption", {"num_blocks": 40}, num_others=10, spread=4),
        Scenario("spec-ngram", {"speculative_method": "ngram", "num_speculative_tokens": 4,
                                "spec_adaptive": False}, num_others=6, spread=4),
        Scenario("one-thread", {}, num_others=5, spread=3, threads=1),
    ]


# A bfloat16 model's big all-decode steps at two threads run in two slices of rows, a thread
# each (runner/cpu_decode.py, row_parts): 63 others at once in a pool of 4096 tokens.
ROW_SLICES = Scenario("row-slices", {"max_num_seqs": 64, "block_size": 16}, num_others=63,
                      threads=2, row_split=True)


def run_scenario(make_engine, cases, sc: Scenario, vocab: int, seed: int = 0):
    others = fillers(cases, vocab, sc.num_others, seed, share_prefix=sc.share_prefix)
    saved = torch.get_num_threads()
    if sc.threads:
        torch.set_num_threads(sc.threads)
    try:
        engine = make_engine(**sc.engine_kwargs)
        if sc.warm:
            run(engine, [], others, seed=seed)
        return run(engine, cases, [] if sc.warm else others, seed=seed, spread=sc.spread)
    finally:
        torch.set_num_threads(saved)


def check_perturbed(sc: Scenario, p: Perturbed) -> None:
    """The scenario perturbed what it claims to (else a pass would prove nothing)."""
    if sc.num_others and not sc.warm:
        assert p.max_batch > 1, (sc.name, p)
    if "max_num_batched_tokens" in sc.engine_kwargs:
        assert p.chunked > 0, (sc.name, p)
    if sc.warm:
        assert p.prefix_hit_tokens > 0, (sc.name, p)
    if "num_blocks" in sc.engine_kwargs:
        assert p.preemptions > 0, (sc.name, p)
    if "speculative_method" in sc.engine_kwargs:
        assert p.spec_accepted > 0, (sc.name, p)
    if sc.row_split:
        assert p.row_split_steps > 0, (sc.name, p)


def check_invariant_kernels(engine) -> None:
    """`engine` ran deterministic mode's kernels: per-row attention, and every linear of the
    model one batch-invariant kernel at every row count (no oneDNN, no MixedLinear forms)."""
    from servelm.layers.amx_linear import AmxLinear
    from servelm.layers.det_linear import DetLinear
    from servelm.layers.dot_linear import DotLinear

    runner = engine.runner
    assert runner.backend.deterministic
    stack = runner.cpu_stack
    assert runner.backend.deterministic_steps + (0 if stack is None else stack.steps) > 0
    linears = [m for m in runner.model.modules() if "Linear" in type(m).__name__]
    assert linears and {type(m) for m in linears} <= {DetLinear, DotLinear, AmxLinear}, linears


def write_report(name: str, report: dict) -> str:
    """The divergence report as JSON: $SERVELM_DETERMINISM_REPORT_DIR (default: the
    system's temp dir), printed too."""
    import tempfile

    directory = os.environ.get("SERVELM_DETERMINISM_REPORT_DIR", tempfile.gettempdir())
    path = os.path.join(directory, f"determinism-{name}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n[determinism] {name}: {json.dumps(report['summary'])} -> {path}")
    return path
