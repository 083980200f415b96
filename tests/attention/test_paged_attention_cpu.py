"""The C++ CPU decode kernel computes what the torch path computes.

Kernel level: random paged caches with scrambled block tables, odd batch sizes, context
lengths crossing block boundaries, GQA ratios 1/3/4, head dims 64/128, fp32 and bf16, sliding
windows and soft-capped scores, against a float64 reference written here. Backend level: a
mixed step (decodes + prefill chunks) through the torch backend with the kernel and with the
gather + SDPA path. Engine level: a tiny random model gives the same greedy tokens on either
path. Plus which path is chosen.
"""

import pytest
import torch

from servelm import cpu_kernels
from servelm.attention import paged_attention_cpu
from servelm.attention.forward_batch import ForwardBatch
from servelm.attention.kv_cache import KVCache
from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.config import ModelConfig
from servelm.llm import LLM
from servelm.protocol import SamplingParams
from span_batches import batch_from_spans  # tests/span_batches.py (tests/ is on sys.path)


@pytest.fixture(scope="module")
def kernel():
    return cpu_kernels.load().paged_decode  # a failed build fails these tests, never skips


def _random_problem(gen, batch, num_heads, num_kv_heads, head_dim, block_size, lens, dtype):
    """Caches of 2x the blocks needed, each sequence's blocks drawn at random from them."""
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = 2 * sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen)
    width = max(blocks) + 2  # padded rows, as ForwardBatch pads them
    tables = torch.zeros(batch, width, dtype=torch.long)
    used = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = order[used:used + nb]
        used += nb
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.long)


def _reference(q, k_cache, v_cache, tables, lens, block_size, scale, window=0, softcap=0.0):
    """float64, one sequence and one head at a time, slots computed from the picture; the
    last `window` positions only (0: all), scores soft-capped by tanh (0: not)."""
    batch, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        for h in range(num_heads):
            keys = k_cache[slots, h // group].double()  # [C, D]
            values = v_cache[slots, h // group].double()
            scores = keys @ q[b, h].double() * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            out[b, h] = torch.softmax(scores, dim=0) @ values
    return out


def test_fp8_codes_decode_exactly(kernel):
    """Every e4m3fn code but NaN (subnormals, zeros, saturation at +-448) as a K and V row
    of length one: attention returns V's value exactly, times v_scale."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes
    n = codes.numel()  # 254 slots, one per code, one KV head, D = 16 (code repeated)
    cache = codes.repeat_interleave(16).view(n, 1, 16).view(torch.float8_e4m3fn)
    q = torch.zeros(n, 1, 16)
    tables = torch.arange(n, dtype=torch.long)[:, None]
    one = torch.ones(n, dtype=torch.long)
    ks, vs = torch.tensor([1.0]), torch.tensor([0.5])
    out = kernel(q, cache, cache, tables, one, 1, 1.0, ks, vs)
    want = cache[:, :, :].float() * 0.5
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match="float8 caches"):
        kernel(q, cache, cache, tables, one, 1, 1.0)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("batch", [1, 5])
def test_fp8_kernel_matches_reference(kernel, num_heads, num_kv_heads, batch):
    """fp8 caches with a scale per KV head: against the float64 reference on the
    dequantized caches."""
    gen = torch.Generator().manual_seed(batch + num_heads)
    block_size, head_dim = 16, 64
    lens = [300] if batch == 1 else [1, 17, 33, 100, 250][:batch]
    q, k_cache, v_cache, tables, seq_lens = _random_problem(
        gen, batch, num_heads, num_kv_heads, head_dim, block_size, lens, torch.float32)
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    ks = torch.rand(num_kv_heads, generator=gen) + 0.5
    vs = torch.rand(num_kv_heads, generator=gen) + 0.5
    scale = head_dim ** -0.5
    out = kernel(q, k8, v8, tables, seq_lens, block_size, scale, ks, vs)
    ref = _reference(q, k8.float() * ks[:, None], v8.float() * vs[:, None], tables, seq_lens,
                     block_size, scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("batch", [1, 5, 17])
def test_kernel_matches_reference(kernel, dtype, head_dim, num_heads, num_kv_heads, batch):
    gen = torch.Generator().manual_seed(batch * 1000 + num_heads * 10 + head_dim)
    block_size = 16
    edges = [1, 15, 16, 17, 32, 33, 300]  # around block boundaries, and the longest
    lens = [edges[b] if b < len(edges) else int(torch.randint(1, 301, (1,), generator=gen))
            for b in range(batch)]
    if batch == 1:
        lens = [300]
    q, k_cache, v_cache, tables, seq_lens = _random_problem(
        gen, batch, num_heads, num_kv_heads, head_dim, block_size, lens, dtype)
    scale = head_dim ** -0.5
    out = kernel(q, k_cache, v_cache, tables, seq_lens, block_size, scale)
    assert out.dtype == torch.float32 and out.shape == q.shape
    ref = _reference(q, k_cache, v_cache, tables, seq_lens, block_size, scale)
    # bf16 inputs are exact in fp32: only the fp32 accumulation differs from the reference.
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(1, 0.0), (16, 0.0), (40, 0.0), (0, 2.0),
                                            (24, 2.0), (500, 0.5)])
def test_sliding_window_and_soft_cap_match_reference(kernel, dtype, window, softcap):
    """A window (the last `window` keys, the walk starting mid-block and mid-tile) and tanh
    soft-capped scores (caps low enough to change every score), on both of a bfloat16
    cache's q . k paths; contexts shorter and longer than the window."""
    gen = torch.Generator().manual_seed(window * 10 + int(softcap * 4))
    lens = [1, 15, 16, 17, 33, 300, 47]
    q, k_cache, v_cache, tables, seq_lens = _random_problem(gen, len(lens), 8, 2, 64, 16,
                                                            lens, dtype)
    scale = 64 ** -0.5
    out = kernel(q, k_cache, v_cache, tables, seq_lens, 16, scale, window=window,
                 softcap=softcap)
    ref = _reference(q, k_cache, v_cache, tables, seq_lens, 16, scale, window, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    plain = _reference(q, k_cache, v_cache, tables, seq_lens, 16, scale)
    assert not torch.allclose(ref, plain, atol=1e-3)  # the variant changed the result
    with pytest.raises(RuntimeError, match="window and softcap"):
        kernel(q, k_cache, v_cache, tables, seq_lens, 16, scale, window=-1)


@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 2)])
def test_bf16_dot_products_and_widened_rows_both_match_reference(kernel, head_dim, num_heads,
                                                                 num_kv_heads):
    """A bfloat16 q and cache: q . k on vdpbf16ps where the CPU runs it (the default there),
    and on rows widened to float32 (elsewhere, and for D % 32 != 0)."""
    from servelm.cpu_kernels import isa

    ops = cpu_kernels.load()
    usable = isa.usable("avx512_bf16")
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    lens = [1, 16, 33, 300, 47]
    q, k_cache, v_cache, tables, seq_lens = _random_problem(
        gen, 5, num_heads, num_kv_heads, head_dim, 16, lens, torch.bfloat16)
    scale = head_dim ** -0.5
    ref = _reference(q, k_cache, v_cache, tables, seq_lens, 16, scale)
    outs = {}
    try:
        for use in (False, True):
            assert ops.paged_decode_use_bf16_dot(use) == (use and usable)
            outs[use] = kernel(q, k_cache, v_cache, tables, seq_lens, 16, scale)
            torch.testing.assert_close(outs[use].double(), ref, atol=2e-6, rtol=1e-5)
    finally:
        ops.paged_decode_use_bf16_dot(usable)
    if usable and head_dim % 32 == 0:  # the two paths ran: sums in another order
        assert not torch.equal(outs[True], outs[False])


def test_kernel_block_sizes_and_odd_head_dim(kernel):
    """Block sizes other than 16 and a head dim with no specialised code path."""
    gen = torch.Generator().manual_seed(7)
    for block_size in (1, 4, 32):
        lens = [1, block_size, block_size + 1, 3 * block_size - 1, 70]
        q, k_cache, v_cache, tables, seq_lens = _random_problem(
            gen, len(lens), 6, 2, 80, block_size, lens, torch.float32)
        out = kernel(q, k_cache, v_cache, tables, seq_lens, block_size, 0.3)
        ref = _reference(q, k_cache, v_cache, tables, seq_lens, block_size, 0.3)
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_kernel_softmax_survives_large_scores(kernel):
    """Scores in the hundreds: the running max must keep every exp in range."""
    gen = torch.Generator().manual_seed(3)
    lens = [5, 40, 200]
    q, k_cache, v_cache, tables, seq_lens = _random_problem(
        gen, 3, 4, 2, 64, 16, lens, torch.float32)
    q, k_cache = q * 30, k_cache * 30
    out = kernel(q, k_cache, v_cache, tables, seq_lens, 16, 0.125)
    ref = _reference(q, k_cache, v_cache, tables, seq_lens, 16, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [3, 13])
def test_kernel_result_does_not_depend_on_threads(kernel, batch):
    """1 or 2 threads, whole sequences or (sequence, KV head) items: the same bits."""
    gen = torch.Generator().manual_seed(11)
    lens = [int(x) for x in torch.randint(1, 200, (batch,), generator=gen)]
    args = _random_problem(gen, batch, 9, 3, 64, 16, lens, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(*args, 16, 0.125)
        torch.set_num_threads(2)
        two = kernel(*args, 16, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, two, atol=0, rtol=0)


def test_kernel_rejects_bad_inputs(kernel):
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, tables, seq_lens = _random_problem(
        gen, 2, 4, 2, 64, 16, [20, 3], torch.float32)
    tables[0, 1] = k_cache.shape[0] // 16  # one past the last block
    with pytest.raises(RuntimeError, match="block_tables"):
        kernel(q, k_cache, v_cache, tables, seq_lens, 16, 0.125)
    with pytest.raises(RuntimeError, match="seq_lens"):
        kernel(q, k_cache, v_cache, tables, torch.tensor([0, 3]), 16, 0.125)
    q, k_cache, v_cache, tables, seq_lens = _random_problem(
        gen, 2, 4, 2, 72, 16, [20, 3], torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel(q, k_cache, v_cache, tables, seq_lens, 16, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_what_index_copy_writes(dtype):
    store = cpu_kernels.load().store_kv
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache = (torch.randn(64, 3, 16, generator=gen).to(dtype) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(5, 9 + 3 + 3, 16, generator=gen).to(dtype)  # k, v: strided views
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([7, 0, 63, 20, 21])
    store(k_cache, v_cache, slots, k, v)
    want_k.index_copy_(0, slots, k)
    want_v.index_copy_(0, slots, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="slot 64 out of range"):
        store(k_cache, v_cache, torch.tensor([1, 2, 3, 4, 64]), k, v)
    with pytest.raises(RuntimeError, match="one dtype"):
        store(k_cache, v_cache, slots, k.double(), v)
    assert torch.equal(k_cache, want_k)  # a rejected call wrote nothing


def test_kv_cache_store_uses_store_kv(monkeypatch):
    ops = cpu_kernels.load()
    calls = []
    from servelm.attention import kv_cache as kv_module

    class Spy:
        def store_kv(self, *args):
            calls.append(args[2])
            ops.store_kv(*args)

    monkeypatch.setattr(kv_module, "_store_ops", lambda cache: Spy())
    cfg = ModelConfig("llama", 32, 64, 64, 1, 4, 2, 16, 64)
    cache = KVCache(cfg, 4, 4, torch.float32, torch.device("cpu"))
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    cache.store(0, torch.tensor([3, 9]), k, v)
    assert len(calls) == 1 and torch.equal(cache.layer(0)[0][9], k[1])


def _mixed_batch(block_size: int) -> ForwardBatch:
    """3 decodes (contexts 6, 9 and 40: past a block edge), a fresh 5-token prompt, 4 new
    tokens after a 7-token prefix. Blocks are handed out in a scrambled order."""
    spans = [(5, 1), (8, 1), (39, 1), (0, 5), (7, 4)]  # (context, new tokens)
    free = torch.randperm(40, generator=torch.Generator().manual_seed(1)).tolist()
    return batch_from_spans(spans, block_size, free, num_decodes=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_backend_step_matches_torch_path(kernel, dtype, num_heads, num_kv_heads):
    config = ModelConfig("llama", 32, 64, 64, 1, num_heads, num_kv_heads, 16, 64)
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    caches, backends = {}, {}
    for path in ("kernel", "torch"):
        caches[path] = KVCache(config, 40, 4, dtype, torch.device("cpu"))
        backends[path] = TorchAttentionBackend(caches[path], num_heads, 0.25,
                                               decode_kernel_mode=path)
    assert backends["kernel"].decode_kernel is not None
    assert backends["torch"].decode_kernel is None
    caches["kernel"].k.copy_(torch.randn(caches["kernel"].k.shape, generator=gen))
    caches["kernel"].v.copy_(torch.randn(caches["kernel"].v.shape, generator=gen))
    caches["torch"].k.copy_(caches["kernel"].k)
    caches["torch"].v.copy_(caches["kernel"].v)
    batch = _mixed_batch(4)
    q = torch.randn(batch.num_tokens, num_heads, 16, generator=gen).to(dtype)
    k = torch.randn(batch.num_tokens, num_kv_heads, 16, generator=gen).to(dtype)
    v = torch.randn(batch.num_tokens, num_kv_heads, 16, generator=gen).to(dtype)
    outs = {}
    for path, backend in backends.items():
        batch.attn_metadata = backend.build_metadata(batch)
        outs[path] = backend.forward(0, q, k, v, batch)
    assert outs["kernel"].dtype == dtype
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(outs["kernel"], outs["torch"], **tol)


def _greedy(engine, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    outs = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("arch,kv_heads,block_size", [("llama", 2, 4), ("llama", 1, 16),
                                                      ("qwen3", 1, 4)])
def test_tiny_model_greedy_tokens_match_torch_path(kernel, tiny_hf, tiny_engine, arch, kv_heads,
                                                   block_size):
    hf = tiny_hf(arch, num_key_value_heads=kv_heads)
    shared = [7, 200, 31, 5, 99, 42, 18]  # a cached prefix ending mid-block
    prompts = [shared + [3, 14, 15, 92, 65, 35, 89, 79, 32, 38], shared + [11, 12],
               [250, 1], shared, list(range(40, 80))]
    results = {}
    for path in ("kernel", "torch"):
        engine = tiny_engine(hf, max_num_batched_tokens=16, block_size=block_size,
                             cpu_kernels=f"attention={path}")
        backend = engine.runner.backend
        assert (backend.decode_kernel is not None) == (path == "kernel")
        _greedy(engine, [shared + [1]], 1)  # warm the prefix cache
        results[path] = _greedy(engine, prompts, 24)
    for ours, ref in zip(results["kernel"], results["torch"]):
        assert ours.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in ours.logprobs]),
                                   torch.tensor([lp.logprob for lp in ref.logprobs]),
                                   atol=1e-4, rtol=1e-4)


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader's once-per-process state, restored after the test."""
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    monkeypatch.setattr(cpu_kernels, "_warned", False)
    return monkeypatch


def test_path_choice(fresh_loader):
    def pool(dtype=torch.float32, head_dim=64, device="cpu"):
        return torch.empty(2, 8, 2, head_dim, dtype=dtype, device=device)

    choose = paged_attention_cpu.decode_kernel_for
    assert choose(pool(), "torch") is None
    assert choose(pool()) is not None  # the process's choice: 'auto' by default
    assert choose(pool(torch.float16)) is None
    assert choose(pool(torch.float8_e4m3fn)) is not None  # with the head scales
    assert choose(pool(device="meta")) is None
    assert choose(pool(head_dim=72)) is None and choose(pool(head_dim=512)) is None
    assert choose(pool(torch.bfloat16, head_dim=96)) is not None
    with pytest.raises(ValueError, match="attention='fast'"):
        choose(pool(), "fast")
