"""The CPU decode stack (runner/cpu_decode.py, cpu_kernels/decode_stack.cpp) runs all-decode
steps through the same kernels in the same order as the eager model: the same tokens and
bit-identical logprobs with `--cpu-kernels decode=torch`, for float32 and bfloat16 models,
int8 and int4 layers, float32, bfloat16 and fp8 KV caches, GQA, qkv biases (Qwen2) and q/k norms (Qwen3); and it stays out of the steps and setups it does
not cover."""

from __future__ import annotations

import pytest
import torch

from servelm.llm import LLM
from servelm.protocol import SamplingParams
from servelm.runner import cpu_decode

PROMPTS = [[5, 17, 99, 3, 250, 11, 42], list(range(100, 160)), [7], list(range(200, 223))]


def _run(engine, max_tokens=20, logprobs=2):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            logprobs=logprobs)
    outs = LLM(engine=engine).generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("quantization,kv,dtype", [
    (None, "auto", "float32"), ("int8", "auto", "float32"), ("int4-g32", "auto", "float32"),
    (None, "fp8", "float32"), (None, "auto", "bfloat16"), (None, "fp8", "bfloat16")])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_stack_matches_the_eager_model_bit_for_bit(tiny_hf, tiny_engine, arch, quantization,
                                                   kv, dtype):
    hf = tiny_hf(arch)
    kwargs = dict(max_num_batched_tokens=32, quantization=quantization, kv_cache_dtype=kv,
                  dtype=dtype)
    engine = tiny_engine(hf, cpu_kernels="decode=kernel", **kwargs)
    stack = engine.runner.cpu_stack
    assert stack is not None
    ours = _run(engine)
    assert stack.steps >= 15  # the decode-only steps after the prompts are in
    eager_engine = tiny_engine(hf, cpu_kernels="decode=torch", **kwargs)
    assert eager_engine.runner.cpu_stack is None
    for a, b in zip(ours, _run(eager_engine)):
        assert a.token_ids == b.token_ids
        # every position: the token's logprob and the top-2 alternatives', exactly
        assert [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs] == \
            [(lp.token_id, lp.logprob, lp.top) for lp in b.logprobs]


def test_stack_stays_out_where_it_does_not_apply(tiny_hf, tiny_engine):
    hf = tiny_hf("llama")
    assert tiny_engine(hf, dtype="float16").runner.cpu_stack is None
    engine = tiny_engine(hf)
    # a prefill step (and a mixed one) runs eagerly
    outs = LLM(engine=engine).generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0),
                                       use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 1 and engine.runner.cpu_stack.steps == 0
    with pytest.raises(ValueError, match="cpu_kernels: decode='fast'"):
        tiny_engine(hf, cpu_kernels="decode=fast")
    with pytest.raises(ValueError, match="cpu_kernels: decode='fast'"):  # a direct caller's
        cpu_decode.CpuDecodeStack.for_model(engine.runner.model, None, engine.runner.backend,
                                            mode="fast")


def test_stack_with_speculative_decoding_keeps_the_tokens(tiny_hf, tiny_engine):
    """n-gram speculation (no logprobs: requests asking for them are not speculated):
    verification steps run eagerly, plain decode steps in the stack; greedy tokens are those
    of the model without speculation."""
    hf = tiny_hf("llama")
    plain = _run(tiny_engine(hf), max_tokens=40, logprobs=None)
    engine = tiny_engine(hf, speculative_method="ngram", num_speculative_tokens=3,
                         spec_adaptive=False)
    spec = _run(engine, max_tokens=40, logprobs=None)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stack = engine.runner.cpu_stack
    assert engine.stats.spec_num_proposed > 0 and stack.verify_steps > 0
    assert stack.steps > stack.verify_steps  # plain decode steps too


@pytest.mark.parametrize("quantization", [None, "int4-g32"])
def test_verification_rows_are_causal_attention_over_the_chunk(tiny_hf, tiny_engine,
                                                               quantization):
    """A sequence with context and a few new tokens (as a verification is) through the stack,
    one decode row per token, scores them like the eager path's chunked prefill, within float
    rounding; a fresh prompt of a few tokens stays eager."""
    from servelm.core.runner_state import score_item
    from servelm.engine.sequence import Sequence
    from servelm.protocol import RequestTimings

    hf = tiny_hf("qwen3")
    prompt = list(range(40, 71))
    logits = {}
    for mode in ("kernel", "torch"):
        engine = tiny_engine(hf, quantization=quantization, cpu_kernels=f"decode={mode}")
        seq = Sequence("p", 0, prompt, SamplingParams(max_tokens=1), RequestTimings(), 1)
        engine.block_manager.allocate(seq, len(prompt))
        score = lambda start, n: engine.runner.score(  # noqa: E731
            [score_item(seq.token_ids, seq.block_table, start, n)])
        score(0, 27)  # a prefill chunk: eager either way
        logits[mode] = score(27, 4)
        stack = engine.runner.cpu_stack
        if mode == "kernel":
            assert stack.verify_steps == 1 and stack.steps == 1
            fresh = Sequence("q", 1, prompt[:3], SamplingParams(max_tokens=1),
                             RequestTimings(), 1)
            engine.block_manager.allocate(fresh, 3)
            engine.runner.score([score_item(fresh.token_ids, fresh.block_table, 0, 3)])
            assert stack.steps == 1  # a fresh prompt is a prefill
    assert logits["kernel"].shape == (4, 384)
    torch.testing.assert_close(logits["kernel"], logits["torch"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("draft", ["quantized-copy", "early-exit"])
def test_draft_models_run_their_steps_in_a_stack(tmp_path, tiny_hf, tiny_engine, draft):
    """A draft model's proposals through its own stack (a separate model, int4-quantized,
    with its own KV cache; or the target's first layer): the same greedy tokens as without
    speculation."""
    hf = tiny_hf("llama")
    plain = _run(tiny_engine(hf), max_tokens=24, logprobs=None)
    if draft == "quantized-copy":
        hf.save_pretrained(tmp_path)
        kw = dict(spec_draft_model=str(tmp_path), spec_draft_quantization="int4-g32")
    else:
        kw = dict(spec_draft_layers=1)
    engine = tiny_engine(hf, speculative_method="draft", num_speculative_tokens=3,
                         spec_adaptive=False, **kw)
    spec = _run(engine, max_tokens=24, logprobs=None)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stack = engine.runner.proposer.stack
    assert stack is not None and stack.steps > 0


def test_row_parts_cuts_plain_decode_steps_into_two_balanced_slices():
    """Two slices of at least ROW_PART_MIN_ROWS rows each, only at two threads; the cut
    balances whole row blocks of the linears and context (attention)."""
    row_parts, least = cpu_decode.row_parts, cpu_decode.ROW_PART_MIN_ROWS
    block, row = cpu_decode.GEMM_ROW_BLOCK, cpu_decode.ROW_COST_POSITIONS
    assert row_parts([150] * 64, 2) == [0, 32, 64]
    assert row_parts([150] * (2 * least - 1), 2) == [0, 2 * least - 1]  # too few rows
    assert row_parts([150] * 64, 1) == [0, 64] and row_parts([150] * 64, 4) == [0, 64]
    # a little more context on one side does not move the cut off a row block ...
    assert row_parts([160] * 32 + [150] * 32, 2) == [0, 32, 64]
    # ... much more does, by whole blocks: the long contexts' slice takes fewer rows
    lens = [400] * 32 + [10] * 32
    cut = row_parts(lens, 2)[1]
    assert least <= cut < 32 and cut % block == 0

    def worst(c):  # the costlier slice at cut c, as row_parts prices it
        blocks = lambda n: -(-n // block) * block * row  # noqa: E731
        return max(blocks(c) + sum(lens[:c]), blocks(64 - c) + sum(lens[c:]))

    assert worst(cut) == min(worst(c) for c in range(least, 64 - least + 1))
    # never fewer than the minimum rows in a slice, however skewed the contexts
    assert row_parts([100_000] + [1] * (2 * least), 2)[1] == least


needs_dot = pytest.mark.skipif(
    "not __import__('servelm.layers.dot_linear', fromlist=['x']).dot_usable()"
    " or __import__('servelm.layers.amx_linear', fromlist=['x']).amx_usable()",
    reason="a bfloat16 model's linears are DotLinears only where avx512_bf16 runs and AMX "
           "does not")


@needs_dot
def test_many_row_decode_steps_run_in_slices_with_the_eager_tokens(tiny_hf, tiny_engine):
    """A bfloat16 model on DotLinears at two threads: decode steps of >= 2 x
    ROW_PART_MIN_ROWS rows run as two slices of rows, a thread each (DecodeStack.run_parts),
    with the eager model's tokens and logprobs, bit for bit."""
    hf = tiny_hf("llama")
    prompts = [[(7 * i + 3 * j) % 380 + 1 for j in range(2 + i % 13)] for i in range(56)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    kwargs = dict(dtype="bfloat16", max_num_seqs=64, num_blocks=1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = {}
        for mode in ("kernel", "torch"):
            engine = tiny_engine(hf, cpu_kernels=f"decode={mode}", **kwargs)
            gen = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
            outs[mode] = [o.outputs[0] for o in gen]
            if mode == "kernel":
                stack = engine.runner.cpu_stack
                assert stack.split_steps >= 10 and stack.split_steps == stack.steps
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(outs["kernel"], outs["torch"]):
        assert a.token_ids == b.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs] == \
            [(lp.token_id, lp.logprob, lp.top) for lp in b.logprobs]


def _kquant(kind: str, out_f: int, in_f: int, seed: int, max_int8_rows: int = 128):
    """A KQuantLinear of random `kind` super-blocks (the documented layouts: any byte pattern
    is a valid block; small float16 super-block scales keep the activations in range)."""
    import numpy as np

    from servelm.quant.kquant_linear import KQUANT_TYPES, KQuantLinear

    rng = np.random.default_rng(seed)
    per_row, block_bytes = in_f // 256, KQUANT_TYPES[kind][1]
    raw = rng.integers(0, 256, (out_f, per_row, block_bytes), dtype=np.uint8)
    d = (rng.uniform(0.2, 1.0, (out_f, per_row, 2)) * 2e-4).astype(np.float16)
    if kind == "Q6_K":
        raw[..., 208:210] = d[..., :1].view(np.uint8)  # ... | scales int8 x16 | d
    else:
        raw[..., 0:4] = d.view(np.uint8).reshape(out_f, per_row, 4)  # d | dmin | ...
    codes = torch.from_numpy(raw.reshape(out_f, per_row * block_bytes))
    return KQuantLinear(kind, codes, (out_f, in_f), None, max_int8_rows=max_int8_rows)


def _kquant_layers(model, seed: int) -> None:
    """A Q4_K_M-like model: q/k in Q4_K beside v in Q6_K (row parts), o_proj in Q5_K whose
    steps of more than 2 rows dequantize, gate_up in Q4_K, down in Q6_K."""
    from servelm.quant.row_parts_linear import RowPartsLinear

    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        hidden, q = attn.qkv_proj.in_features, attn.num_heads * attn.head_dim
        kv = attn.num_kv_heads * attn.head_dim
        s = seed + 10 * i
        attn.qkv_proj = RowPartsLinear([_kquant("Q4_K", q, hidden, s),
                                        _kquant("Q4_K", kv, hidden, s + 1),
                                        _kquant("Q6_K", kv, hidden, s + 2)])
        attn.o_proj = _kquant("Q5_K", hidden, q, s + 3, max_int8_rows=2)
        inter = mlp.down_proj.in_features
        mlp.gate_up_proj = _kquant("Q4_K", 2 * inter, hidden, s + 4)
        mlp.down_proj = _kquant("Q6_K", hidden, inter, s + 5)


def _assert_same_outputs(ours, eager):
    for a, b in zip(ours, eager):
        assert a.token_ids == b.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs] == \
            [(lp.token_id, lp.logprob, lp.top) for lp in b.logprobs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_runs_k_quant_layers_and_row_parts_bit_for_bit(tiny_hf, tiny_engine, dtype):
    """GGUF K-quant matrices (one rounding of x to q8_K shared by a fused layer's K-quant
    parts; more rows than a layer's q8_K limit on its dequantized GEMM) give the eager
    path's tokens and logprobs exactly."""
    from servelm.quant.decode_entry import KIND_KQUANT, KIND_PARTS, decode_entry

    hf = tiny_hf("llama", hidden_size=256, intermediate_size=512)
    outs = {}
    for mode in ("kernel", "torch"):
        engine = tiny_engine(hf, cpu_kernels=f"decode={mode}", dtype=dtype,
                             max_num_batched_tokens=32)
        _kquant_layers(engine.runner.model, seed=3)
        outs[mode] = _run(engine)
        stack = engine.runner.cpu_stack
        if mode == "kernel":
            assert stack is not None and stack.steps >= 15
            assert cpu_decode.refusal(engine.runner.model, stack.kv_cache, stack.backend) is None
            entry = decode_entry(engine.runner.model.layers[0].self_attn.qkv_proj)
            assert entry.kind == KIND_PARTS and entry.kernel_kinds == {KIND_KQUANT}
        else:
            assert stack is None
    _assert_same_outputs(outs["kernel"], outs["torch"])


def test_stack_runs_permuted_layers_with_one_gather_bit_for_bit(tiny_hf, tiny_engine):
    """GPTQ act-order layers (PermutedLinear: int4 codes over gathered inputs) in the stack:
    the eager path's tokens and logprobs exactly; a permutation that is not the identity
    changes them (the gather is not skipped)."""
    from servelm.quant.permuted_linear import PermutedLinear

    hf = tiny_hf("qwen2")  # qkv biases: the inner layer's, added after the product
    outs = {}
    for mode, seed in (("kernel", 0), ("torch", 0), ("kernel-other", 1)):
        engine = tiny_engine(hf, cpu_kernels=f"decode={mode.split('-')[0]}",
                             quantization="int4-g32", max_num_batched_tokens=32)
        gen = torch.Generator().manual_seed(seed)
        for layer in engine.runner.model.layers:
            for owner, name in ((layer.self_attn, "qkv_proj"), (layer.mlp, "down_proj")):
                inner = getattr(owner, name)
                setattr(owner, name, PermutedLinear(
                    inner, torch.randperm(inner.in_features, generator=gen)))
        outs[mode] = _run(engine)
        if mode != "torch":
            assert engine.runner.cpu_stack.steps >= 15
    _assert_same_outputs(outs["kernel"], outs["torch"])
    assert [o.logprobs[0].logprob for o in outs["kernel"]] != \
        [o.logprobs[0].logprob for o in outs["kernel-other"]]


def test_stack_returns_the_hidden_states_after_aux_layers(tiny_hf, tiny_engine):
    """An EAGLE-3 drafter's features (the hidden state after some layers) come from the stack
    as the eager forward's `aux_layers` gives them, bit for bit, with the final states."""
    from servelm.attention.forward_batch import ForwardBatch

    engine = tiny_engine(tiny_hf("llama"), cpu_kernels="decode=kernel")
    runner, bs = engine.runner, engine.block_manager.block_size
    model, backend, stack = runner.model, runner.backend, runner.cpu_stack
    tables = torch.tensor([[0, 1]])  # blocks 0 and 1: slot = position
    ids, pos = torch.tensor([5, 17, 99, 3, 250, 11]), torch.arange(6)
    prompt = ForwardBatch(ids, pos, pos.clone(), tables, [0, 6], [0], [6], 0, bs,
                          torch.tensor([5]))
    prompt.attn_metadata = backend.build_metadata(prompt)
    decode = ForwardBatch(torch.tensor([42]), torch.tensor([6]), torch.tensor([6]), tables,
                          [0, 1], [6], [7], 1, bs, torch.tensor([0]))
    with torch.no_grad():
        model(ids, pos, prompt)  # the prompt's K/V into the cache
        got = stack.maybe_run(decode, aux_layers=(1, 0))
        decode.attn_metadata = backend.build_metadata(decode)
        want = model(decode.input_ids, decode.positions, decode, aux_layers=(1, 0))
    out, aux = got
    assert stack.steps == 1
    assert torch.equal(out, want.out) and len(aux) == 2
    assert all(torch.equal(a, b) for a, b in zip(aux, want.aux, strict=True))
    assert not torch.equal(aux[0], aux[1])
