"""The C++ prefill kernel (cpu_kernels/prefill_attention.cpp) computes causal attention over
the paged cache as a float64 reference does.

Kernel level: every prefill of a step in one call: fresh prompts and chunks after cached
context, one-row chunks, row counts that leave the last 16-lane group part empty, GQA groups
1/3/4/8, head dims 64/96/128, block sizes 1/16/32, scrambled block tables; large scores;
threads; bad tables. Backend level: a mixed step through the torch backend with the kernel and
without it. Engine level: a bfloat16 tiny model scores prompts through it as through the torch
path. The kernel needs avx512_bf16 (probed to run); elsewhere only the path choice is tested.
"""

import pytest
import torch

from servelm import cpu_kernels
from servelm.attention import paged_attention_cpu
from servelm.attention.forward_batch import ForwardBatch
from servelm.attention.kv_cache import KVCache
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.config import ModelConfig
from span_batches import batch_from_spans  # tests/span_batches.py (tests/ is on sys.path)


def _ops():
    return cpu_kernels.load()  # a failed build fails these tests, never skips


def _available() -> bool:
    return _ops().paged_prefill_available()


needs_kernel = pytest.mark.skipif("not _available()",
                                  reason="the prefill kernel needs a usable avx512_bf16")


def _problem(gen, spans, num_heads, num_kv_heads, head_dim, block_size):
    """spans: [(context, rows)] per sequence. Caches of 2x the blocks needed, each sequence's
    blocks drawn at random from them; K/V of every position (context and chunk) in place."""
    blocks = [-(-(c + n) // block_size) for c, n in spans]
    num_blocks = 2 * sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(spans), max(blocks) + 2, dtype=torch.long)
    used = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = order[used:used + nb]
        used += nb
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    rows = [n for _, n in spans]
    q = torch.randn(sum(rows), num_heads, head_dim, generator=gen).bfloat16()
    query_start = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.long)
    context = torch.tensor([c for c, _ in spans], dtype=torch.long)
    return q, k_cache, v_cache, tables, query_start, context


def _reference(q, k_cache, v_cache, tables, query_start, context, block_size, scale):
    """float64, one sequence and one head at a time: row i sees positions 0 .. ctx + i."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(len(context)):
        q0, q1, ctx = int(query_start[s]), int(query_start[s + 1]), int(context[s])
        pos = torch.arange(ctx + q1 - q0)
        slots = tables[s, pos // block_size] * block_size + pos % block_size
        visible = pos[None, :] <= ctx + torch.arange(q1 - q0)[:, None]
        for h in range(q.shape[1]):
            keys = k_cache[slots, h // group].double()
            values = v_cache[slots, h // group].double()
            scores = (q[q0:q1, h].double() @ keys.T * scale).masked_fill(~visible, float("-inf"))
            out[q0:q1, h] = torch.softmax(scores, dim=-1) @ values
    return out


SPANS = [(0, 1), (0, 5), (0, 6), (0, 40), (3, 17), (16, 16), (100, 33), (37, 1), (0, 146)]


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 2), (4, 4), (8, 1)])
def test_kernel_matches_reference(head_dim, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(head_dim + 10 * num_heads + num_kv_heads)
    args = _problem(gen, SPANS, num_heads, num_kv_heads, head_dim, 16)
    scale = head_dim ** -0.5
    out = _ops().paged_prefill(*args, 16, scale)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    torch.testing.assert_close(out.double(), _reference(*args, 16, scale), atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_kernel_block_sizes(block_size):
    gen = torch.Generator().manual_seed(block_size)
    spans = [(0, block_size), (block_size - 1, 2), (2 * block_size + 1, 20), (0, 70)]
    args = _problem(gen, spans, 6, 2, 64, block_size)
    out = _ops().paged_prefill(*args, block_size, 0.3)
    torch.testing.assert_close(out.double(), _reference(*args, block_size, 0.3), atol=2e-6,
                               rtol=1e-5)


@needs_kernel
def test_kernel_softmax_survives_large_scores():
    """Scores in the hundreds: the running max must keep every exp in range, and a row's
    masked (future) keys must weigh nothing however large their scores."""
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, tables, qs, ctx = _problem(gen, [(0, 40), (20, 50)], 4, 2, 64, 16)
    q, k_cache = (q.float() * 30).bfloat16(), (k_cache.float() * 30).bfloat16()
    args = (q, k_cache, v_cache, tables, qs, ctx)
    out = _ops().paged_prefill(*args, 16, 0.125)
    assert torch.isfinite(out).all()
    # scores near 1000: float32's rounding of them (~1e-4) is the tolerance's scale
    torch.testing.assert_close(out.double(), _reference(*args, 16, 0.125), atol=3e-4, rtol=1e-3)


@needs_kernel
def test_kernel_result_does_not_depend_on_threads():
    gen = torch.Generator().manual_seed(11)
    args = _problem(gen, SPANS, 9, 3, 64, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _ops().paged_prefill(*args, 16, 0.125)
        torch.set_num_threads(2)
        two = _ops().paged_prefill(*args, 16, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, two, atol=0, rtol=0)


@needs_kernel
def test_kernel_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, tables, qs, ctx = _problem(gen, [(4, 20), (0, 3)], 4, 2, 64, 16)
    ops = _ops()
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0] // 16  # one past the last block
    with pytest.raises(RuntimeError, match="block_tables"):
        ops.paged_prefill(q, k_cache, v_cache, bad, qs, ctx, 16, 0.125)
    with pytest.raises(RuntimeError, match="query_start"):
        ops.paged_prefill(q, k_cache, v_cache, tables, torch.tensor([0, 20, 22]), ctx, 16, 0.125)
    with pytest.raises(RuntimeError, match="query row"):
        ops.paged_prefill(q, k_cache, v_cache, tables, torch.tensor([0, 23, 23]), ctx, 16, 0.125)
    with pytest.raises(RuntimeError, match="q must be bfloat16"):
        ops.paged_prefill(q.float(), k_cache, v_cache, tables, qs, ctx, 16, 0.125)


def _mixed_batch(block_size: int) -> ForwardBatch:
    """Two decodes, a fresh 37-token prompt, a 9-token chunk after 20 cached positions."""
    spans = [(10, 1), (33, 1), (0, 37), (20, 9)]
    return batch_from_spans(spans, block_size, range(3, 200), num_decodes=2)


def _backends_and_step(gen):
    """A backend with the kernel and one without, over caches of the same random K/V, and
    a mixed step's batch with its q, k, v."""
    config = ModelConfig("llama", 32, 576, 64, 1, 9, 3, 64, 64)
    caches, backends = {}, {}
    for path in ("kernel", "torch"):
        caches[path] = KVCache(config, 60, 4, torch.bfloat16, torch.device("cpu"))
        backends[path] = TorchAttentionBackend(caches[path], 9, 0.125, decode_kernel_mode=path)
    assert backends["kernel"].prefill_kernel is not None
    assert backends["torch"].prefill_kernel is None
    for name in ("k", "v"):
        getattr(caches["kernel"], name).copy_(torch.randn(caches["kernel"].k.shape, generator=gen))
        getattr(caches["torch"], name).copy_(getattr(caches["kernel"], name))
    batch = _mixed_batch(4)
    q, k, v = (torch.randn(batch.num_tokens, h, 64, generator=gen).bfloat16()
               for h in (9, 3, 3))
    return caches, backends, batch, (q, k, v)


@needs_kernel
def test_backend_step_matches_torch_path():
    caches, backends, batch, (q, k, v) = _backends_and_step(torch.Generator().manual_seed(1))
    outs, metas = {}, {}
    for path, backend in backends.items():
        batch.attn_metadata = metas[path] = backend.build_metadata(batch)
        outs[path] = backend.forward(0, q, k, v, batch)
    assert backends["kernel"].prefill_kernel_calls == 1
    assert backends["torch"].prefill_kernel_calls == 0
    assert outs["kernel"].dtype == torch.bfloat16
    torch.testing.assert_close(outs["kernel"], outs["torch"], atol=1e-2, rtol=1e-2)
    # the kernel against float64: its error is that of rounding the output to bfloat16
    rows = slice(2, None)
    meta = metas["kernel"]
    ref = _reference(q[rows], caches["kernel"].k[0], caches["kernel"].v[0], meta.prefill_tables,
                     meta.prefill_query_start, meta.prefill_context_lens, 4, 0.125)
    torch.testing.assert_close(outs["kernel"][rows].double(), ref, atol=1e-2, rtol=8e-3)


@needs_kernel
def test_a_window_layer_in_a_kernel_step_builds_its_slots_on_first_use():
    """The kernel's step skips the per-sequence context slots; a sliding-window layer (which
    the prefill kernel does not take) builds them when it first runs. Its prefill rows are
    the torch path's bit for bit; its decodes run on the C++ decode kernel, which takes the
    window (as the decode stack runs them), so they match within bfloat16 rounding."""
    _, backends, batch, (q, k, v) = _backends_and_step(torch.Generator().manual_seed(2))
    outs = {}
    for path, backend in backends.items():
        batch.attn_metadata = backend.build_metadata(batch)
        assert (batch.attn_metadata.prefill_slots is None) == (path == "kernel")
        outs[path] = backend.forward(0, q, k, v, batch, window=8)
        assert batch.attn_metadata.prefill_slots is not None
    assert backends["kernel"].prefill_kernel_calls == 0
    nd = batch.num_decodes
    torch.testing.assert_close(outs["kernel"][nd:], outs["torch"][nd:], atol=0, rtol=0)
    torch.testing.assert_close(outs["kernel"][:nd], outs["torch"][:nd], atol=1e-2, rtol=1e-2)


@needs_kernel
def test_bf16_engine_scores_prompts_through_the_kernel(tiny_hf, tiny_engine):
    """A bfloat16 tiny model (head dim 64) scores the same logits on either path, and its
    prefills took the kernel."""
    from tiny_models import prefill_logits

    hf = tiny_hf("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    prompt = [int(x) for x in torch.randint(0, 384, (45,), generator=torch.Generator()
                                            .manual_seed(2))]
    logits = {}
    for path in ("kernel", "torch"):
        engine = tiny_engine(hf, dtype="bfloat16", cpu_kernels=f"attention={path}")
        logits[path] = prefill_logits(engine, prompt).float()
        calls = engine.runner.backend.prefill_kernel_calls
        assert (calls > 0) == (path == "kernel")
    assert torch.equal(logits["kernel"].argmax(-1), logits["torch"].argmax(-1))
    torch.testing.assert_close(logits["kernel"], logits["torch"], atol=0.1, rtol=0.05)


def test_path_choice():
    def pool(dtype=torch.bfloat16, head_dim=64, device="cpu"):
        return torch.empty(2, 8, 2, head_dim, dtype=dtype, device=device)

    choose = paged_attention_cpu.prefill_kernel_for
    assert choose(pool(), "torch") is None
    assert (choose(pool()) is not None) == _available()
    assert choose(pool(torch.float32)) is None
    assert choose(pool(torch.float8_e4m3fn)) is None
    assert choose(pool(device="meta")) is None
    assert choose(pool(head_dim=48)) is None and choose(pool(head_dim=512)) is None
    with pytest.raises(ValueError, match="attention='fast'"):
        choose(pool(), "fast")
