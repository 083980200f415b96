"""Adapter slots: more adapters than slots under load, LRU eviction of unpinned adapters
only, deferred unload, and no request ever computed with another adapter."""

import pytest
from conftest import save_adapter
from tiny_models import make_tiny_engine

from servelm.config import ModelConfig
from servelm.llm import LLM
from servelm.lora.slots import LoraNotFoundError, LoraSlots
from servelm.protocol import EngineRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(base_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for i in range(6):
        save_adapter(base_hf, root / f"a{i}", r=4 + 2 * (i % 3), seed=200 + i, scale=0.15,
                     targets=["q_proj", "v_proj", "gate_proj", "down_proj"])
    return root


def test_lru_evicts_only_unpinned(base_hf, adapters):
    slots = LoraSlots(2, 16, ModelConfig.from_hf_config(base_hf.config.to_dict()))
    ids = [slots.register(f"a{i}", str(adapters / f"a{i}")).lora_id for i in range(3)]
    assert slots.acquire(ids[0]) == 0 and slots.acquire(ids[1]) == 1
    assert not slots.can_acquire(ids[2])  # both pinned
    slots.release(ids[0])
    assert slots.can_acquire(ids[2])
    assert slots.acquire(ids[2]) == 0  # the unpinned one's slot
    assert slots.num_evictions == 1 and slots.num_loads == 3
    assert not slots.is_resident(ids[0]) and slots.is_resident(ids[1])
    deltas = slots.drain()
    assert [a.name for a in deltas.added] == ["a0", "a1", "a2"]
    assert deltas.slots == {0: ids[2], 1: ids[1]}
    assert slots.drain() is None
    with pytest.raises(LoraNotFoundError) as info:
        slots.lookup("a9")
    assert info.value.code == "model_not_found"


def _solo_outputs(base_hf, adapters, prompts, names):
    specs = tuple(f"a{i}={adapters / f'a{i}'}" for i in range(6))
    llm = LLM(engine=make_tiny_engine(base_hf, lora_modules=specs, max_loras=6))
    return [llm.generate([p], GREEDY, lora=n, use_tqdm=False)[0].outputs[0].token_ids
            for p, n in zip(prompts, names)]


def test_more_adapters_than_slots_under_load(base_hf, adapters):
    prompts = [[5 + i, 9, 33, 2 + i % 5, 7, 100 + i] for i in range(18)]
    names = [f"a{i % 6}" if i % 4 else None for i in range(18)]
    want = _solo_outputs(base_hf, adapters, prompts, names)
    assert len({tuple(w) for w, n in zip(want, names) if n}) >= 5  # adapters differ
    specs = tuple(f"a{i}={adapters / f'a{i}'}" for i in range(6))
    engine = make_tiny_engine(base_hf, lora_modules=specs, max_loras=2, max_num_seqs=4)
    got = {}
    for i, (p, n) in enumerate(zip(prompts, names)):
        engine.add_request(EngineRequest(str(i), p, GREEDY, lora_name=n))
    max_resident = 0
    while engine.has_unfinished:
        for d in engine.step():
            got.setdefault(int(d.request_id), []).extend(d.token_ids)
        engine.check_invariants()  # every running adapter resident and pinned
        running = {s.lora_id for s in engine.scheduler.running if s.lora_id is not None}
        assert len(running) <= 2
        max_resident = max(max_resident, engine.loras.num_resident)
    assert [got[i] for i in range(len(prompts))] == want
    assert max_resident == 2
    assert engine.loras.num_evictions > 0 and engine.loras.num_loads > 6
    report = engine.report()
    assert report.lora_num_evictions == engine.loras.num_evictions
    assert report.lora_num_adapters == 6


def test_unload_waits_for_requests_in_flight(base_hf, adapters):
    specs = (f"a0={adapters / 'a0'}", f"a1={adapters / 'a1'}")
    engine = make_tiny_engine(base_hf, lora_modules=specs, max_loras=1)
    llm = LLM(engine=engine)
    want = llm.generate([[1, 2, 3]], GREEDY, lora="a0", use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request(EngineRequest("x", [1, 2, 3], GREEDY, lora_name="a0"))
    out = [t for d in engine.step() for t in d.token_ids]  # running, its adapter pinned
    lora_id = engine.loras.lookup("a0").lora_id
    assert engine.unload_lora("a0") is False  # deferred: a request still uses it
    assert engine.lora_names() == ["a1"]
    with pytest.raises(LoraNotFoundError):
        engine.add_request(EngineRequest("y", [1, 2, 3], GREEDY, lora_name="a0"))
    while engine.has_unfinished:
        for d in engine.step():
            out += d.token_ids
    assert out == want
    assert lora_id not in engine.loras.by_id  # gone once the last request finished
    llm.generate([[4, 5]], GREEDY, use_tqdm=False)  # the runner hears of it with a step
    assert lora_id not in engine.runner.lora.host
    # The name can be loaded again (a new id: no KV of the old one is shared).
    engine.load_lora("a0", str(adapters / "a2"))
    assert engine.loras.lookup("a0").lora_id != lora_id


def test_prefix_cache_is_keyed_by_adapter(base_hf, adapters):
    specs = (f"a0={adapters / 'a0'}", f"a1={adapters / 'a1'}")
    engine = make_tiny_engine(base_hf, lora_modules=specs, max_loras=2)
    llm = LLM(engine=engine)
    prompt = list(range(40, 72))
    first = llm.generate([prompt], GREEDY, lora="a0", use_tqdm=False)[0]
    other = llm.generate([prompt], GREEDY, lora="a1", use_tqdm=False)[0]
    assert other.timings.num_cached_tokens == 0  # a1 never reads a0's KV
    again = llm.generate([prompt], GREEDY, lora="a0", use_tqdm=False)[0]
    assert again.timings.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert base.timings.num_cached_tokens == 0
