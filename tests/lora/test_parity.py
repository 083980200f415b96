"""LoRA through servelm's engine against PEFT on tiny random-weight Llama models: logits equal
PEFT's model and the merged model's (float32), and a batch mixing adapters and base-model
requests gives each request its solo greedy output."""

import pytest
import torch
from conftest import ALL_TARGETS, save_adapter
from tiny_models import make_tiny_engine

from servelm.core.runner_state import score_item
from servelm.engine.sequence import Sequence
from servelm.layers.dot_linear import DotLinear, dot_usable
from servelm.llm import LLM
from servelm.protocol import RequestTimings, SamplingParams
from servelm.runner.model_runner import _Work, build_forward_batch

PROMPT = [3, 17, 101, 5, 250, 42, 7, 9, 300, 11, 64]


def lora_logits(engine, prompt, name):
    """Logits at every prompt position, scored in `engine` with adapter `name` (None: base),
    through the runner's own step forward."""
    runner = engine.runner
    lora_id = None
    if name is not None:
        lora_id = engine.loras.lookup(name).lora_id
        engine.loras.acquire(lora_id)
        runner.lora.apply(engine.loras.drain())
    seq = Sequence("p", 0, prompt, SamplingParams(max_tokens=1), RequestTimings(), 1)
    engine.block_manager.allocate(seq, len(prompt))
    try:
        item = score_item(seq.token_ids, seq.block_table, 0, len(prompt))
        item.seq.lora_id = lora_id
        works = [_Work.of(item)]
        fb = build_forward_batch(works, runner.block_size, runner.device)
        if runner.lora is not None:
            fb.lora = runner.lora.batch_for(works, fb.query_start_loc)
        with torch.inference_mode():
            return runner.model.compute_logits(runner._forward(fb)).float()
    finally:
        engine.block_manager.free(seq)
        if lora_id is not None:
            engine.loras.release(lora_id)


def hf_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


CASES = [
    dict(r=8, targets=ALL_TARGETS, alpha=16),
    dict(r=4, targets=["q_proj", "v_proj"], alpha=8),
    dict(r=16, targets=["k_proj", "o_proj", "down_proj"], alpha=32, use_rslora=True),
    dict(r=2, targets=["gate_proj", "up_proj"], alpha=4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c['r']}-{'+'.join(c['targets'])}")
def test_logits_match_peft_and_merged(base_hf, tmp_path, case):
    peft_model = save_adapter(base_hf, tmp_path / "ad", seed=case["r"], **case)
    engine = make_tiny_engine(base_hf, lora_modules=(f"ad={tmp_path / 'ad'}",),
                              max_lora_rank=16)
    ours = lora_logits(engine, PROMPT, "ad")
    ref = hf_logits(peft_model, PROMPT)
    base = hf_logits(base_hf, PROMPT)
    assert (ref - base).abs().max() > 0.1  # the adapter really changes the model
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert engine.runner.lora.num_lora_steps == 1
    merged = peft_model.merge_and_unload()
    torch.testing.assert_close(ours, hf_logits(merged, PROMPT), atol=2e-4, rtol=1e-4)
    merged_engine = make_tiny_engine(merged)  # no LoRA at all: the merged weights
    from tiny_models import prefill_logits
    torch.testing.assert_close(ours, prefill_logits(merged_engine, PROMPT), atol=2e-4,
                               rtol=1e-4)
    # The base model in the same engine is untouched by the adapter in its slot.
    torch.testing.assert_close(lora_logits(engine, PROMPT, None), base, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("gather", [False, True], ids=["per-group", "gathered"])
def test_mixed_batch_matches_solo(base_hf, tmp_path, monkeypatch, gather):
    """8 adapters (different ranks and targets) and base requests in one batch: each request's
    greedy output equals its output alone; adapters change outputs. `gathered`: decode steps
    take the CPU's gathered path (servelm/lora/segmented.py), as with many adapters."""
    from servelm.lora import segmented

    if gather:
        monkeypatch.setattr(segmented, "GATHER_MIN_GROUPS", 2)
    specs = []
    for i in range(8):
        targets = ALL_TARGETS if i % 2 == 0 else ["q_proj", "v_proj", "down_proj"]
        save_adapter(base_hf, tmp_path / f"a{i}", r=[2, 4, 8, 16][i % 4], targets=targets,
                     alpha=16, seed=100 + i, scale=0.15)
        specs.append(f"a{i}={tmp_path / f'a{i}'}")
    engine = make_tiny_engine(base_hf, lora_modules=tuple(specs), max_loras=8)
    llm = LLM(engine=engine)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT[:5 + i % 6] + [i] for i in range(12)]
    names = [f"a{i}" if i < 8 else None for i in range(12)]
    solo = [llm.generate([p], greedy, lora=n, use_tqdm=False)[0].outputs[0].token_ids
            for p, n in zip(prompts, names)]
    steps_before = engine.runner.lora.num_lora_steps
    together = [o.outputs[0].token_ids
                for o in llm.generate(prompts, greedy, lora=names, use_tqdm=False)]
    assert together == solo
    assert engine.runner.lora.num_lora_steps > steps_before
    assert (engine.runner.lora.num_gathered_steps > 0) == gather
    base = llm.generate(prompts[:8], greedy, use_tqdm=False)
    changed = sum(b.outputs[0].token_ids != s for b, s in zip(base, solo[:8]))
    assert changed >= 6  # adapters really change greedy outputs
    assert len({tuple(s) for s in solo[:8]}) >= 6


def test_base_batches_take_the_usual_path(base_hf, tmp_path):
    """A step without adapter rows runs the runner's own path (on this CPU: the C++ decode
    stack for decodes), LoRA on or not; no LoRA forward runs for it."""
    save_adapter(base_hf, tmp_path / "ad", r=4)
    engine = make_tiny_engine(base_hf, lora_modules=(f"ad={tmp_path / 'ad'}",))
    llm = LLM(engine=engine)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = make_tiny_engine(base_hf)
    want = LLM(engine=plain).generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stack = engine.runner.cpu_stack
    before = stack.steps if stack is not None else 0
    got = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    assert engine.runner.lora.num_lora_steps == 0
    if stack is not None:
        assert stack.steps > before


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_families_match_peft(tmp_path, arch):
    from tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model(arch, seed=4)
    peft_model = save_adapter(hf, tmp_path / "ad", r=8, targets=ALL_TARGETS, seed=9)
    engine = make_tiny_engine(hf, lora_modules=(f"ad={tmp_path / 'ad'}",))
    ours = lora_logits(engine, PROMPT, "ad")
    ref = hf_logits(peft_model, PROMPT)
    assert (ref - hf_logits(hf, PROMPT)).abs().max() > 0.1
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_adapters_ride_on_quantized_base_weights(base_hf, tmp_path):
    """int8 weight-only base: the adapter's change of the logits is PEFT's (the base
    projection keeps its own kernel; the product is added to its output)."""
    peft_model = save_adapter(base_hf, tmp_path / "ad", r=8, targets=ALL_TARGETS, seed=3)
    engine = make_tiny_engine(base_hf, quantization="int8",
                              lora_modules=(f"ad={tmp_path / 'ad'}",))
    delta = lora_logits(engine, PROMPT, "ad") - lora_logits(engine, PROMPT, None)
    ref = hf_logits(peft_model, PROMPT) - hf_logits(base_hf, PROMPT)
    assert ref.abs().max() > 0.1
    assert (delta - ref).abs().max() < 0.1 * ref.abs().max()
    assert engine.runner.lora.num_lora_steps == 1


@pytest.mark.skipif(not dot_usable(),
                    reason="avx512_bf16 does not run here: no DotLinear, no fused gate_up")
def test_a_gate_up_adapter_reaches_a_bf16_models_fused_mlp(base_hf, tmp_path):
    """A bfloat16 model's gate_up takes silu_and_mul in one pass (DotLinear's gated form);
    the adapter's hook on that layer must still add to the gate and up."""
    peft_model = save_adapter(base_hf, tmp_path / "gu", seed=5, r=4,
                              targets=["gate_proj", "up_proj"], alpha=8)
    engine = make_tiny_engine(base_hf, dtype="bfloat16", lora_modules=(f"gu={tmp_path / 'gu'}",),
                              max_lora_rank=16)
    assert any(type(m) is DotLinear for m in engine.runner.model.modules())
    ours = lora_logits(engine, PROMPT, "gu")
    ref = hf_logits(peft_model, PROMPT)
    base = hf_logits(base_hf, PROMPT)
    assert (ref - base).abs().max() > 0.1
    torch.testing.assert_close(ours, ref, atol=0.05, rtol=0.05)
    torch.testing.assert_close(lora_logits(engine, PROMPT, None), base, atol=0.05, rtol=0.05)
