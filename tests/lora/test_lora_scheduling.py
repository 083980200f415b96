"""Property test of LoRA scheduling with a model-free runner: random arrivals, adapters,
slots, aborts and unloads. After every step the block and slot invariants hold, and the
runner, which keeps its own slot table from the step deltas only, computes each sequence
with the adapter the sequence asked for: outputs equal those computed one at a time."""

import pytest
from conftest import save_adapter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelm.config import ModelConfig, SchedulerConfig
from servelm.core.contract import SampledToken, StepResult
from servelm.core.runner_state import RunnerState
from servelm.engine.block_manager import BlockManager
from servelm.engine.engine import Engine
from servelm.lora.slots import LoraSlots
from servelm.protocol import EngineRequest, SamplingParams

NUM_ADAPTERS = 5


class SlotRunner:
    """Tokens depend on the sequence's tokens and on the adapter *in the slot the runner
    believes holds it*: a wrong slot table gives other tokens."""

    def __init__(self):
        self.state = RunnerState()
        self.slot_of: dict[int, int] = {}
        self.slots: dict[int, int] = {}  # slot -> lora_id it holds
        self.known: set[int] = set()
        self.num_lora_rows = 0

    def execute(self, step):
        scheduled = self.state.apply(step)
        if step.lora is not None:
            self.known |= {a.lora_id for a in step.lora.added}
            for lora_id in step.lora.removed:
                self.known.discard(lora_id)
                slot = self.slot_of.pop(lora_id, None)
                if slot is not None:
                    self.slots.pop(slot, None)
            for slot, lora_id in step.lora.slots.items():
                assert lora_id in self.known
                old = self.slots.get(slot)
                if old is not None:
                    self.slot_of.pop(old, None)
                self.slots[slot], self.slot_of[lora_id] = lora_id, slot
        out = []
        for s in scheduled:
            adapter = None
            if s.seq.lora_id is not None:
                adapter = self.slots[self.slot_of[s.seq.lora_id]]
                self.num_lora_rows += 1
            if s.is_sampling:
                out.append(SampledToken(s.seq.seq_id, token(s.seq.token_ids, adapter)))
        return StepResult(out)


def token(token_ids, lora_id):
    return hash((tuple(token_ids), lora_id)) % 990 + 10


def expected(prompt, lora_id, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(token(ids, lora_id))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def adapter_dirs(base_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    for i in range(NUM_ADAPTERS):
        save_adapter(base_hf, root / f"a{i}", r=2, targets=["q_proj"], seed=i)
    return [str(root / f"a{i}") for i in range(NUM_ADAPTERS)]


request = st.tuples(st.lists(st.integers(10, 999), min_size=1, max_size=12),  # prompt
                    st.integers(-1, NUM_ADAPTERS - 1),  # adapter (-1: base)
                    st.integers(1, 6))  # max_tokens
plan = st.lists(st.tuples(st.lists(request, max_size=4),  # arrivals before a step
                          st.booleans(),  # abort the oldest live request
                          st.integers(-1, NUM_ADAPTERS - 1)),  # unload this adapter
                min_size=1, max_size=25)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plan, num_slots=st.integers(1, 3), prefix=st.booleans())
def test_no_sequence_ever_runs_with_another_adapter(base_hf, adapter_dirs, plan, num_slots,
                                                    prefix):
    config = ModelConfig.from_hf_config(base_hf.config.to_dict())
    loras = LoraSlots(num_slots, 8, config)
    for i, path in enumerate(adapter_dirs):
        loras.register(f"a{i}", path)
    runner = SlotRunner()
    engine = Engine(runner, None, BlockManager(48, 4, prefix), SchedulerConfig(24, 6, True),
                    256, 1000, (1,), loras=loras)
    want, got, aborted, live = {}, {}, set(), []
    next_id = 0
    for arrivals, abort, unload in plan:
        for prompt, adapter, max_tokens in arrivals:
            name = None if adapter < 0 else f"a{adapter}"
            if name is not None and name not in loras.by_name:
                continue  # unloaded earlier: refused (tested elsewhere)
            rid = str(next_id)
            next_id += 1
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(EngineRequest(rid, prompt, params, lora_name=name))
            lora_id = None if name is None else loras.by_name[name].lora_id
            want[rid] = expected(prompt, lora_id, max_tokens)
            live.append(rid)
        if abort and live:
            aborted.add(live[0])
            engine.abort(live.pop(0))
        if unload >= 0 and f"a{unload}" in loras.by_name:
            engine.unload_lora(f"a{unload}")
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
            if d.timings is not None and d.request_id in live:
                live.remove(d.request_id)
        engine.check_invariants()
    while engine.has_unfinished:
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
        engine.check_invariants()
    for rid, tokens in want.items():
        if rid in aborted:
            assert got.get(rid, []) == tokens[:len(got.get(rid, []))]
        else:
            assert got[rid] == tokens, rid
    assert not loras.pinned()  # every pin given back
    removing = [e for e in loras.by_id.values() if e.is_removing]
    assert not removing  # unloaded adapters are gone once their requests are
