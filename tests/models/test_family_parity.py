"""Parity with Hugging Face transformers for the MoE and other non-Llama families, on tiny
random-weight checkpoints transformers builds: prefill logits, 32 greedy decode steps with
their top logprobs, and the same tokens when requests are batched, chunked, hit the prefix
cache and are preempted. The planner's parameter counts equal the loaded model's. The C++
decode stack takes a family's decode steps with the eager model's bits (sliding windows,
soft-caps, sandwich norms, GeGLU, mixtures of experts and DeepSeek's latent attention
included; float32, and bfloat16 for the variant, expert and latent families), or the start-up
log names the layer and the part it cannot take; an early exit at N layers is the first N
layers of the full model.
"""

import logging

import pytest
import torch

from tiny_families import FAMILIES, make_tiny_family_model
from tiny_models import make_tiny_engine, prefill_logits
from servelm.config import ModelConfig
from servelm.cost import count_params
from servelm.llm import LLM
from servelm.protocol import SamplingParams

ALL = sorted(FAMILIES)
# Whether the C++ decode stack (runner/cpu_decode.py) takes a family's decode steps (None),
# else words of the reason its fast path (models/fast_path.py) gives
STACK = {"phi3_full": None, "qwen2_yarn": None, "mistral_window": None, "phi3": None,
         "gemma2": None, "gemma3": None, "mixtral": None, "qwen2_moe": None, "qwen3_moe": None,
         "deepseek_v2": None, "deepseek_v3": None}


@pytest.fixture(scope="module", params=ALL)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def hf(family):
    return make_tiny_family_model(family)


def test_prefill_logits_match_transformers(hf):
    engine = make_tiny_engine(hf)
    prompt = torch.randint(0, hf.config.vocab_size, (37,),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0]
    torch.testing.assert_close(prefill_logits(engine, prompt.tolist()), ref,
                               atol=1e-4, rtol=1e-4)


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        # An explicit mask: generate() would take pad_token_id in a prompt for padding.
        gen = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                            dtype=torch.long),
                          max_new_tokens=n,
                          do_sample=False, output_logits=True, return_dict_in_generate=True,
                          pad_token_id=0)
    return gen.sequences[0, len(prompt):].tolist(), gen.logits


def test_32_decode_steps_match_transformers(hf):
    llm = LLM(engine=make_tiny_engine(hf))
    prompt = [5, 17, 99, 3, 250, 11, 42]
    out = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                              logprobs=5), use_tqdm=False)[0].outputs[0]
    ref_tokens, ref_logits = _hf_greedy(hf, prompt, 32)
    assert out.token_ids == ref_tokens
    for step, (lp, logits) in enumerate(zip(out.logprobs, ref_logits)):
        ref_top = torch.log_softmax(logits[0].float(), dim=-1).topk(5)
        assert [t for t, _ in lp.top] == ref_top.indices.tolist(), f"step {step}"
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), ref_top.values,
                                   atol=1e-4, rtol=1e-4)


def test_batched_chunked_prefix_hits_and_preemption_match_transformers(hf):
    # 6 prompts sharing a 24-token prefix (prefix-cache hits), prefills chunked at 16 tokens,
    # 30 blocks of 4 tokens for up to 6 x 64 tokens (preemption).
    prefix = [(7 * i + 3) % hf.config.vocab_size for i in range(24)]
    prompts = [prefix + [(11 * i + j) % hf.config.vocab_size for j in range(3 + 4 * i)]
               for i in range(6)]
    engine = make_tiny_engine(hf, num_blocks=30, max_num_batched_tokens=16)
    outs = LLM(engine=engine).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 16)[0]


def _num_weights(model) -> int:
    """Parameters of a loaded model; a PackedLinear keeps its weight as a buffer in oneDNN's
    layout, counted by its shape (a tied head's packed copy of the embedding not at all)."""
    from servelm.layers.linear import PackedLinear

    total = sum(p.numel() for p in model.parameters())
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear) and not (name == "lm_head"
                                                and model.config.tie_word_embeddings):
            total += m.in_features * m.out_features + (0 if m.bias is None else m.out_features)
    return total


def test_param_counts_equal_the_loaded_model(hf):
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    engine = make_tiny_engine(hf, cpu_kernels="gemm=torch")  # one form of each weight
    model = engine.runner.model
    total = _num_weights(model)
    counts = count_params(config)
    assert counts.total == total == sum(p.numel() for p in hf.parameters())
    routed = sum(m.w13.numel() + m.w2.numel() for m in model.modules()
                 if hasattr(m, "w13"))
    unchosen = routed * (1 - config.num_experts_per_tok / max(config.num_experts, 1))
    assert counts.active == total - unchosen


def test_early_exit_forward_runs_the_first_layers(hf):
    """forward(..., layers=N) equals the first N layers then the final norm."""
    from servelm.attention.forward_batch import ForwardBatch

    engine = make_tiny_engine(hf)
    model = engine.runner.model
    backend = engine.runner.backend
    ids = torch.tensor([5, 17, 99, 3])
    pos = torch.arange(4)
    fb = ForwardBatch(ids, pos, torch.arange(4), torch.tensor([[0]]), [0, 4], [0], [4], 0,
                      engine.block_manager.block_size, torch.tensor([3]))
    fb.attn_metadata = backend.build_metadata(fb)
    with torch.no_grad():
        x, residual = model.embed(ids), None
        layer = model.layers[0]
        x, residual = layer(pos, x, residual, fb)
        ref, _ = model.norm(x, residual)
        out = model(ids, pos, fb, layers=1)
    torch.testing.assert_close(out, ref)
    assert not torch.allclose(out, model(ids, pos, fb))


def test_every_family_says_whether_the_stack_takes_it():
    assert set(STACK) == set(FAMILIES)


def test_decode_stack_runs_the_family_bit_for_bit_or_says_why_not(family, hf, caplog):
    """Where the stack takes the family: its decode steps (counted) give the eager model's
    tokens and logprobs exactly; elsewhere the start-up log names the layer and the reason."""
    with caplog.at_level(logging.INFO, logger="servelm.runner.cpu_decode"):
        engine = make_tiny_engine(hf, cpu_kernels="decode=kernel")
    runner, reason = engine.runner, STACK[family]
    if reason is not None:
        assert runner.cpu_stack is None and reason in runner.cpu_stack_refusal
        assert any(r.message.startswith("decode stack: ") and reason in r.message
                   and "run eagerly" in r.message for r in caplog.records)
        return
    assert runner.cpu_stack_refusal is None
    _assert_stack_equals_eager(hf, engine)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_decode_stack_runs_variants_and_experts_bit_for_bit_in_bfloat16(name):
    hf = make_tiny_family_model(name)
    engine = make_tiny_engine(hf, cpu_kernels="decode=kernel", dtype="bfloat16")
    assert engine.runner.cpu_stack_refusal is None
    _assert_stack_equals_eager(hf, engine, dtype="bfloat16")


def test_decode_stack_runs_latent_attention_with_yarn_as_eager_and_transformers():
    """DeepSeek's YaRN: mscale / mscale_all_dim in the rope table and mscale_all_dim squared
    in the softmax scale, which the stack takes from the model (no scale of its own)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
            "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    hf = make_tiny_family_model("deepseek_v3", rope_parameters=yarn)
    engine = make_tiny_engine(hf, cpu_kernels="decode=kernel")
    attn = engine.runner.model.layers[0].self_attn
    assert attn.scale > 1.2 * (attn.nope + attn.rope) ** -0.5  # (1 + 0.1 ln 4)^2 ~ 1.29
    assert engine.runner.cpu_stack_refusal is None
    _assert_stack_equals_eager(hf, engine)
    prompt = [5, 17, 99, 3, 250, 11, 42]
    out = LLM(engine=engine).generate(prompt, SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == _hf_greedy(hf, prompt, 24)[0]


def test_decode_stack_counts_the_tokens_routed_to_each_expert():
    """The stack's MoE layers count each expert's tokens (Experts.num_routed_tokens) as the
    eager layers do."""
    hf = make_tiny_family_model("mixtral")
    engines = [make_tiny_engine(hf, cpu_kernels=f"decode={mode}") for mode in ("kernel",
                                                                               "torch")]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    counts = []
    for engine in engines:
        LLM(engine=engine).generate([[5, 17, 99], [7, 8]], params, use_tqdm=False)
        counts.append([m.num_routed_tokens.clone() for m in engine.runner.model.modules()
                       if hasattr(m, "num_routed_tokens")])
    assert engines[0].runner.cpu_stack.steps >= 6
    assert counts[0] and all(torch.equal(a, b) for a, b in zip(*counts))
    assert sum(int(c.sum()) for c in counts[0]) > 0


def _assert_stack_equals_eager(hf, engine, **kwargs):
    runner = engine.runner
    prompts = [[5, 17, 99, 3, 250, 11, 42], list(range(100, 160)), [7]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    ours = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    assert runner.cpu_stack.steps >= 14  # the decode-only steps after the prompts
    eager = make_tiny_engine(hf, cpu_kernels="decode=torch", **kwargs)
    assert eager.runner.cpu_stack is None
    theirs = LLM(engine=eager).generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, theirs):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs] == \
            [(lp.token_id, lp.logprob, lp.top) for lp in b.logprobs]
