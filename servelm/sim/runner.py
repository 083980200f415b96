"""SimRunner: the Runner protocol without a model.

Owns: a RunnerState built from each StepDescription's deltas (the same one every runner
keeps), synthetic sampled tokens, and the step's time from a StepCostModel, spent by
advancing the replica's virtual clock.
Never: imports torch, or decides anything the scheduler decides.

KV block moves (StepDescription.kv_saves / kv_loads): there are no contents to move, so a
save comes back as a KVBlock with empty data and a load is accepted as it is; what a move
costs in time is the caller's to model (a transfer or tier bandwidth), not the step's.

Tokens: a hash of the sequence so far, kept clear of the EOS ids, so a request ends exactly
at its max_tokens (the workload's output length), as `ignore_eos` requests do on a server.
"""

from __future__ import annotations

from servelm.core.contract import KVBlock, SampledToken, StepDescription, StepResult
from servelm.core.runner_state import RunnerState
from servelm.sim.cost_model import StepCostModel, StepShape, step_shape


class VirtualClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class SimRunner:
    def __init__(self, cost: StepCostModel, clock: VirtualClock, vocab_size: int = 49152,
                 eos_token_ids: tuple[int, ...] = ()):
        self.cost = cost
        self.clock = clock
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self.state = RunnerState()
        self.num_steps = 0
        self.busy_s = 0.0
        # (decodes, context tokens) the step also runs that its description leaves out:
        # the simulator's hidden decodes (servelm/sim/bulk.py mixed_step); None: none.
        self.hidden: tuple[int, int] | None = None

    def execute(self, step: StepDescription) -> StepResult:
        scheduled = self.state.apply(step)
        shape = step_shape(step)
        if self.hidden is not None:
            k, ctx = self.hidden
            shape = StepShape(shape.num_seqs + k, shape.num_decode_tokens + k,
                              shape.num_decode_context_tokens + ctx, shape.num_prefill_tokens,
                              shape.num_prefill_pairs)
        step_s = self.cost.predict(shape)
        self.clock.now += step_s
        self.num_steps += 1
        self.busy_s += step_s
        out = []
        for s in scheduled:
            if s.is_sampling:
                out.append(SampledToken(s.seq.seq_id, self._token(s.seq.token_ids)))
        kv_saved = [KVBlock(b, b"") for b in step.kv_saves]
        return StepResult(out, forward_s=step_s, kv_saved=kv_saved)

    def _token(self, token_ids: list[int]) -> int:
        t = hash((len(token_ids), token_ids[-1])) % (self.vocab_size - 200) + 100
        while t in self.eos:
            t += 1
        return t


__all__ = ["SimRunner", "VirtualClock"]
