"""The Triton SGMV kernel against its torch reference (on the CPU under TRITON_INTERPRET=1,
set by tests/lora/conftest.py before the kernel is imported), and the CUDA LoRA path it
serves against the CPU per-group path."""

import pytest
import torch

from servelm.kernels.lora_sgmv import sgmv, sgmv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _segments(gen, num_tokens, num_slots, num_segments):
    """Segments over a shuffled subset of rows (rows not in any segment must stay as they
    were), each with a random slot; one empty segment included."""
    perm = torch.randperm(num_tokens, generator=gen)[:num_tokens - 3]
    cuts = sorted(torch.randint(0, len(perm), (num_segments - 2,), generator=gen).tolist())
    bounds = [0, 0] + cuts + [len(perm)]  # the first segment is empty
    slots = torch.randint(0, num_slots, (len(bounds) - 1,), generator=gen)
    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    return (perm.to(torch.int32), torch.tensor(bounds, dtype=torch.int32),
            slots.to(torch.int32), max(lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 64, 48), (20, 16, 96), (45, 100, 8)],
                         ids=lambda s: "T{}K{}N{}".format(*s))
def test_sgmv_matches_reference(shape, dtype):
    t, k, n = shape
    gen = torch.Generator().manual_seed(t * 7 + n)
    num_slots = 3
    x = torch.randn(t, k, generator=gen).to(dtype)
    w = (torch.randn(num_slots, n, k, generator=gen) * 0.1).to(dtype)
    base = torch.randn(t, n + 5, generator=gen).to(dtype)  # a column slice is written
    tok, starts, slots, longest = _segments(gen, t, num_slots, 5)
    ref = base.clone()
    sgmv_ref(x, w, ref[:, 2:2 + n], tok, starts, slots)
    ours = base.clone().to(DEVICE)
    sgmv(x.to(DEVICE), w.to(DEVICE), ours[:, 2:2 + n], tok.to(DEVICE), starts.to(DEVICE),
         slots.to(DEVICE), longest)
    ours = ours.cpu()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)
    untouched = torch.ones(t, dtype=torch.bool)
    untouched[tok.long()] = False
    assert torch.equal(ours[untouched], base[untouched])  # rows of no segment, as they were
    assert not torch.equal(ours[~untouched], base[~untouched])  # the kernel wrote its rows


def test_sgmv_rejects_bad_operands():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="shapes disagree"):
        sgmv(x, torch.randn(2, 6, 9), torch.zeros(4, 6), torch.zeros(4, dtype=torch.int32),
             torch.tensor([0, 4], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 4)


def test_segmented_lora_kernel_path_matches_torch_path():
    """add_lora's SGMV path (taken for CUDA tensors) equals its per-group torch path."""
    from servelm.lora import segmented
    from servelm.lora.segmented import add_lora, build_lora_batch

    gen = torch.Generator().manual_seed(5)
    max_rank, sizes, n_in = 8, [24, 8, 8], 32
    a = torch.zeros(3, len(sizes) * max_rank, n_in)
    bs = [torch.zeros(3, s, max_rank) for s in sizes]
    ranks = [8, 4, 2]
    present = [[True, True, True], [True, False, True], [False, True, False]]
    for slot, r in enumerate(ranks):
        for j in range(len(sizes)):
            if present[slot][j]:
                a[slot, j * max_rank:j * max_rank + r] = torch.randn(r, n_in, generator=gen)
                bs[j][slot, :, :r] = torch.randn(sizes[j], r, generator=gen)
    x = torch.randn(11, n_in, generator=gen)
    base = torch.randn(11, sum(sizes), generator=gen)
    batch = build_lora_batch([(0, 1, 2), (1, 1, None), (2, 1, 0), (3, 4, 1), (7, 4, 0)],
                             ranks, "cpu")
    offsets = [0, 24, 32]
    torch_out = base.clone()
    add_lora(x, torch_out, batch, a, bs, offsets, present, max_rank)
    kernel_out = base.clone().to(DEVICE)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    batch_dev = build_lora_batch([(0, 1, 2), (1, 1, None), (2, 1, 0), (3, 4, 1), (7, 4, 0)],
                                 ranks, DEVICE)
    segmented._add_lora_sgmv(dev(x), kernel_out, batch_dev, dev(a), [dev(b) for b in bs],
                             offsets, max_rank)
    torch.testing.assert_close(kernel_out.cpu(), torch_out, atol=1e-4, rtol=1e-4)
    assert torch.equal(torch_out[1], base[1])  # the base row is untouched
    assert not torch.equal(torch_out[0], base[0])


def test_cpu_gathered_path_matches_per_group_path():
    """Many one-row groups (decode over many adapters) take the gathered path on the CPU;
    it equals the per-group loop."""
    from servelm.lora.segmented import GATHER_MIN_GROUPS, add_lora, build_lora_batch

    gen = torch.Generator().manual_seed(8)
    num_slots, max_rank, sizes, n_in = GATHER_MIN_GROUPS + 4, 8, [16, 8, 8], 24
    ranks = [1 + i % max_rank for i in range(num_slots)]
    present = [[(i + j) % 3 != 0 for j in range(3)] for i in range(num_slots)]
    a = torch.zeros(num_slots, 3 * max_rank, n_in)
    bs = [torch.zeros(num_slots, s, max_rank) for s in sizes]
    for slot, r in enumerate(ranks):
        for j in range(3):
            if present[slot][j]:
                a[slot, j * max_rank:j * max_rank + r] = torch.randn(r, n_in, generator=gen)
                bs[j][slot, :, :r] = torch.randn(sizes[j], r, generator=gen)
    num_rows = num_slots + 6
    rows = [(i, 1, None if i % 7 == 3 else (i * 5) % num_slots) for i in range(num_rows)]
    x = torch.randn(num_rows, n_in, generator=gen)
    base = torch.randn(num_rows, sum(sizes), generator=gen)
    gathered = build_lora_batch(rows, ranks, "cpu")
    assert gathered.row_slots is not None
    looped = build_lora_batch(rows, ranks, "cpu")
    looped.row_slots = None
    outs = []
    for batch in (gathered, looped):
        out = base.clone()
        add_lora(x, out, batch, a, bs, [0, 16, 24], present, max_rank)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0][3], base[3])  # a base row
    assert not torch.equal(outs[0][0], base[0])
