"""The bfloat16 kernels of deterministic mode compute a row the same bits whatever else is in
the call (servelm/layers/det_linear.py): servelm's bfloat16 GEMMs (DotLinear on avx512_bf16,
AmxLinear on AMX tiles; the plain, float32-output and gated forms) and the paged attention
kernel over a bfloat16 cache. Each row of a big step is computed again alone and inside
steps of 2 to 300 rows at several places, at one thread and at two, and must come out
bitwise the same. The big step has 2304 rows: past the 64 rows above which the default
hands an AMX CPU's bfloat16 steps to oneDNN, whose blocking follows the row count."""

import pytest
import torch

from servelm import cpu_kernels
from servelm.layers.amx_linear import AmxLinear, amx_usable
from servelm.layers.dot_linear import DotLinear, dot_usable

needs_dot = pytest.mark.skipif(not dot_usable(), reason="avx512_bf16 does not run on this CPU")
needs_amx = pytest.mark.skipif(not amx_usable(), reason="AMX-BF16 does not run on this CPU")

BIG = 2304
STEPS = (1, 2, 7, 8, 9, 16, 17, 33, 63, 64, 65, 300)


def _threads(n: int):
    """A context that runs its body at n intra-op threads."""
    import contextlib

    @contextlib.contextmanager
    def run():
        saved = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(saved)

    return run()


def _check_rows_invariant(f, x: torch.Tensor) -> None:
    """f(rows) for steps of every size in STEPS at three places, and at one thread, is the
    same bits as those rows of f(x)."""
    full = f(x)
    m = x.shape[0]
    for rows in STEPS:
        for start in (0, 5, m - rows):
            part = f(x[start:start + rows].contiguous())
            assert torch.equal(part, full[start:start + rows]), (rows, start)
    with _threads(1):
        assert torch.equal(f(x[:300]), full[:300])
        assert torch.equal(f(x[-1:]), full[-1:])


def _problem(n: int, k: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen) * 0.1 if bias else None
    return torch.randn(BIG, k, generator=gen).bfloat16(), w, b


# The default model's shapes (qkv, o, gate_up, down) and odd ones: K not a multiple of 32,
# N not of 16 or of a 3-block group
SHAPES = [(960, 576, False), (576, 576, False), (3072, 576, False), (576, 1536, False),
          (112, 33, True), (50, 31, True)]


FORMS = [(form, *shape) for form in ("plain", "float") for shape in SHAPES] + [
    ("gated", 3072, 576, False), ("gated", 96, 33, True)]  # [gate; up], I a multiple of 16


@needs_dot
@pytest.mark.parametrize("form,n,k,bias", FORMS)
def test_a_dot_linear_row_is_the_same_bits_in_any_step(form, n, k, bias):
    x, w, b = _problem(n, k, bias, n + k)
    layer = DotLinear(w, b)
    if form == "float":
        layer.float_out()
    _check_rows_invariant(layer.silu_and_mul if form == "gated" else layer, x)


@needs_dot
def test_the_default_models_head_row_is_the_same_bits_in_any_step():
    """The head's float32 logits (49,152 columns: the streamed stores at 4 MiB of output)."""
    x, w, _ = _problem(49152, 576, False, 1)
    head = DotLinear(w, None)
    head.float_out()
    full = head(x[:96])
    for rows in (1, 8, 9, 21, 22, 64):  # 21 rows: under 4 MiB of logits; 22: over
        assert torch.equal(head(x[96 - rows:96].contiguous()), full[96 - rows:]), rows


@needs_amx
@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_an_amx_linear_row_is_the_same_bits_in_any_step(n, k, bias):
    x, w, b = _problem(n, k, bias, n + k)
    _check_rows_invariant(AmxLinear(w, b), x)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (8, 1, 128)])
def test_a_paged_attention_row_is_the_same_bits_in_any_step(heads, kv_heads, head_dim):
    """Rows over their own contexts (as deterministic mode's tokens: every token one row),
    the step split into whole sequences or into (sequence, KV head) items by its size."""
    ops = cpu_kernels.load()
    gen = torch.Generator().manual_seed(heads + head_dim)
    block, num_blocks, rows = 16, 64, 90
    k_cache = torch.randn(num_blocks * block, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks * block, kv_heads, head_dim, generator=gen).bfloat16()
    q = torch.randn(rows, heads, head_dim, generator=gen).bfloat16()
    tables = torch.stack([torch.randperm(num_blocks, generator=gen) for _ in range(rows)])
    lens = torch.randint(1, 40 * block, (rows,), generator=gen)
    scale = head_dim ** -0.5

    def attend(lo: int, hi: int) -> torch.Tensor:
        return ops.paged_decode(q[lo:hi], k_cache, v_cache, tables[lo:hi].contiguous(),
                                lens[lo:hi].contiguous(), block, scale, None, None)

    full = attend(0, rows)
    for n in (1, 2, 3, 7, 8, 9, 33):
        for start in (0, 4, rows - n):
            assert torch.equal(attend(start, start + n), full[start:start + n]), (n, start)
    with _threads(1):
        assert torch.equal(attend(0, rows), full)
        assert torch.equal(attend(10, 11), full[10:11])
