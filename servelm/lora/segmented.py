"""Segmented LoRA products: the flat batch's tokens grouped by adapter slot, one low-rank
product per group (in the spirit of Punica / S-LoRA's SGMV).

Owns: `LoraBatch` (which rows of the flat batch use which slot, built once per step), and
`add_lora` (out[rows of group g, slice j] += (x[rows] @ A[slot_g, j].T) @ B_j[slot_g].T for
every group and every slice of a fused projection the adapter targets). On the CPU it is two
torch matmuls per group and slice, at the adapter's own rank; on CUDA the Triton SGMV kernel
(servelm/kernels/lora_sgmv.py) does all groups of one product in one launch.
Never: decides which adapter a sequence uses or which slot holds it (the engine's LoraSlots
does; the runner's LoraManager copies weights into slots).

    flat batch rows:  [d0 d1 d2 d3 | p0 p0 p0 | p1 p1]     seq slots: d0:2 d1:- d2:2 d3:0 p0:0 p1:-
    groups:           slot 2 -> rows [0, 2]    slot 0 -> rows [3, 4, 5, 6]   (rows 1, 7, 8: none)
    token_idx:        [0 2 | 3 4 5 6]   seg_start: [0 2 6]   seg_slot: [2 0]   (the kernel's view)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraGroup:
    slot: int
    rank: int  # the adapter's rank (slot buffers are max_lora_rank wide, zero beyond it)
    rows: slice | torch.Tensor  # rows of the flat batch: a range, or their indices
    num_rows: int


# On the CPU, from this many groups of at most two rows each (decode steps over many distinct
# adapters) the rows' weights are gathered and multiplied in two batched matmuls instead of
# one pair of matmuls per group: the loop's cost is per group (dispatch), the gather's per
# row. Measured on the 2-core CI machine (busy; best of 30) for SmolLM2-135M's qkv_proj with
# rank-16 q/v adapters, 64 decode rows: 1 group 0.17 ms looped; 8 groups 0.62 ms looped vs
# 1.25 ms gathered; 64 groups 3.85 ms looped vs 1.84 ms gathered.
GATHER_MIN_GROUPS = 24


@dataclass
class LoraBatch:
    groups: list[LoraGroup]
    # For the SGMV kernel: rows sorted by group, each group's start, its slot.
    token_idx: torch.Tensor  # [N] int32
    seg_start: torch.Tensor  # [G + 1] int32
    seg_slot: torch.Tensor  # [G] int32
    max_seg_len: int
    row_slots: torch.Tensor | None = None  # [N] slot of each row of token_idx (CPU gather)

    @property
    def num_rows(self) -> int:
        return sum(g.num_rows for g in self.groups)


def build_lora_batch(row_slots: list[tuple[int, int, int | None]], slot_ranks: list[int],
                     device) -> LoraBatch | None:
    """row_slots: per sequence of the flat batch, (first row, number of rows, slot or None).
    None when no row uses an adapter (the step then runs exactly the no-LoRA path)."""
    by_slot: dict[int, list[tuple[int, int]]] = {}
    for start, n, slot in row_slots:
        if slot is not None and n:
            by_slot.setdefault(slot, []).append((start, n))
    if not by_slot:
        return None
    groups, flat, seg_start, seg_slot = [], [], [0], []
    for slot, spans in by_slot.items():
        idx = [r for start, n in spans for r in range(start, start + n)]
        contiguous = idx[-1] - idx[0] + 1 == len(idx)
        rows = slice(idx[0], idx[-1] + 1) if contiguous else \
            torch.tensor(idx, dtype=torch.long, device=device)
        groups.append(LoraGroup(slot, slot_ranks[slot], rows, len(idx)))
        flat += idx
        seg_start.append(len(flat))
        seg_slot.append(slot)

    def t(x):
        return torch.tensor(x, dtype=torch.int32, device=device)

    row_slots = None
    if len(groups) >= GATHER_MIN_GROUPS and len(flat) <= 2 * len(groups):
        row_slots = torch.tensor([g.slot for g in groups for _ in range(g.num_rows)],
                                 dtype=torch.long, device=device)
    return LoraBatch(groups, t(flat), t(seg_start), t(seg_slot),
                     max(g.num_rows for g in groups), row_slots)


def add_lora(x: torch.Tensor, out: torch.Tensor, batch: LoraBatch, a: torch.Tensor,
             bs: list[torch.Tensor], offsets: list[int], present: list[list[bool]],
             max_rank: int) -> None:
    """In place: out[:, offsets[j]:offsets[j] + size_j] += LoRA of slice j, for each group.

    x: [T, in]; out: [T, out_total]; a: [S, n_slices * R, in] (slice j's A in rows
    j*R .. j*R + rank); bs[j]: [S, size_j, R] (B with the scaling folded in);
    present[slot][j]: the slot's adapter targets slice j."""
    if x.is_cuda:
        _add_lora_sgmv(x, out, batch, a, bs, offsets, max_rank)
        return
    if batch.row_slots is not None:
        _add_lora_gathered(x, out, batch, a, bs, offsets, present, max_rank)
        return
    for g in batch.groups:
        wanted = present[g.slot]
        if not any(wanted):
            continue
        xs = x[g.rows]  # [n, in]
        r = g.rank
        for j, b in enumerate(bs):
            if not wanted[j]:
                continue
            lo = j * max_rank
            d = (xs @ a[g.slot, lo:lo + r].t()) @ b[g.slot, :, :r].t()  # [n, size_j]
            cols = slice(offsets[j], offsets[j] + b.shape[1])
            if isinstance(g.rows, slice):
                out[g.rows, cols] += d
            else:
                out[:, cols].index_add_(0, g.rows, d)


def _add_lora_gathered(x, out, batch: LoraBatch, a, bs, offsets, present, max_rank) -> None:
    """Each row's own A and B gathered (zero beyond its adapter's rank and for slices it
    does not target), two batched matmuls per slice."""
    rows = batch.token_idx.long()
    slots = batch.row_slots
    xs = x.index_select(0, rows).unsqueeze(1)  # [N, 1, in]
    used = {g.slot for g in batch.groups}
    for j, b in enumerate(bs):
        if not any(present[s][j] for s in used):
            continue
        lo = j * max_rank
        xa = torch.bmm(xs, a[slots, lo:lo + max_rank].transpose(1, 2))  # [N, 1, R]
        d = torch.bmm(xa, b[slots].transpose(1, 2)).squeeze(1)  # [N, size_j]
        out[:, offsets[j]:offsets[j] + b.shape[1]].index_add_(0, rows, d)


def _add_lora_sgmv(x, out, batch: LoraBatch, a, bs, offsets, max_rank) -> None:
    from servelm.kernels.lora_sgmv import sgmv

    # One shrink for every slice (zero rows beyond an adapter's rank and for slices it does
    # not target contribute zero), then one expand per slice into its columns.
    y = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    sgmv(x, a, y, batch.token_idx, batch.seg_start, batch.seg_slot, batch.max_seg_len)
    y = y.to(x.dtype)
    for j, b in enumerate(bs):
        lo = j * max_rank
        cols = out[:, offsets[j]:offsets[j] + b.shape[1]]
        sgmv(y[:, lo:lo + max_rank], b, cols, batch.token_idx, batch.seg_start,
             batch.seg_slot, batch.max_seg_len)


__all__ = ["LoraBatch", "LoraGroup", "add_lora", "build_lora_batch"]
