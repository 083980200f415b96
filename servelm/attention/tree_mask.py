"""Tree masks in the torch backend's prefill attention: speculative tree verification.

A sequence verifying a tree of drafts computes, in one step, its fed token(s) and every tree
node, each at its own KV slot (context_len .. seq_len - 1, in node order) but with positions
by depth, so two siblings share a position. Its queries attend the whole cached context and,
within the step's own keys, only what ForwardBatch.tree_masks[i] ([Q, Q] bool) allows: the
fed tokens causally, each node its ancestors and itself (servelm/spec/tree.py builds them).

Such a step's prefills take the backend's masked per-sequence path (a [Q, C] mask over the
gathered context), never the C++ prefill kernel or the split context/chunk path, which know
only causal chunks; prefills without a tree in the same step keep their usual masks there.

Owns: a tree's rows in a ForwardBatch (positions by depth, the mask), turning the step's
tree masks into the backend's prefill metadata, and moving the accepted nodes' K/V to
consecutive slots after verification. Never: drafting the tree or choosing the path
(servelm/spec/tree.py, servelm/sampling/verify.py).

A tree is given as parents[i - 1] of node i (1..N), 0 being the root (the last fed token);
parents come before their children.
"""

from __future__ import annotations

import torch


def apply_tree_masks(backend, batch, meta) -> None:
    """Rewrite `meta` (TorchAttentionMetadata, just built) so that every prefill runs on the
    masked path, with the tree sequences' masks."""
    meta.prefill_tables = meta.prefill_query_start = meta.prefill_context_lens = None
    split, backend.split_prefill = backend.split_prefill, False
    try:
        slots, masks = backend._prefill_contexts(batch)
    finally:
        backend.split_prefill = split
    device = batch.slot_mapping.device
    bs = batch.block_size
    for j, i in enumerate(range(batch.num_decodes, batch.num_seqs)):
        tree = batch.tree_masks.get(i)
        if tree is None:
            continue
        ctx, total = batch.context_lens[i], batch.seq_lens[i]
        if tree.shape != (total - ctx, total - ctx):
            raise ValueError(f"tree_masks[{i}]: shape {tuple(tree.shape)} for "
                             f"{total - ctx} query tokens")
        pos = torch.arange(total, device=device)
        slots[j] = batch.block_tables[i, pos // bs] * bs + pos % bs
        mask = torch.ones(total - ctx, total, dtype=torch.bool, device=device)
        mask[:, ctx:] = tree.to(device)
        masks[j] = mask
    meta.prefill_slots, meta.prefill_masks = slots, masks


def node_depths(parents: list[int]) -> list[int]:
    """Depth of nodes 0 (the root) .. N."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool: row i is True at i and at each of its ancestors."""
    n = len(parents) + 1
    m = torch.zeros(n, n, dtype=torch.bool)
    m[0, 0] = True
    for i, p in enumerate(parents, start=1):
        m[i] = m[p]
        m[i, i] = True
    return m


def set_tree_rows(batch, index: int, num_fed: int, parents: list[int]) -> None:
    """Sequence `index` of `batch` computes num_fed tokens then a tree's N nodes: give its
    nodes positions by depth (root position + depth) and record its [Q, Q] mask (the fed
    tokens causal; each node sees the fed tokens, its ancestors and itself)."""
    s, e = batch.query_start_loc[index], batch.query_start_loc[index + 1]
    q = e - s
    if q != num_fed + len(parents) or num_fed < 1:
        raise ValueError(f"sequence {index}: {q} rows for {num_fed} fed tokens and a tree of "
                         f"{len(parents)} nodes")
    root = batch.context_lens[index] + num_fed - 1
    depth = torch.tensor(node_depths(parents), device=batch.positions.device)
    batch.positions[s + num_fed - 1:e] = root + depth
    m = torch.zeros(q, q, dtype=torch.bool)
    m[:num_fed, :num_fed] = torch.ones(num_fed, num_fed, dtype=torch.bool).tril()
    m[num_fed:, :num_fed] = True
    m[num_fed - 1:, num_fed - 1:] = ancestor_mask(parents)
    if batch.tree_masks is None:
        batch.tree_masks = {}
    batch.tree_masks[index] = m.to(batch.positions.device)


def compact_path_kv(kv_cache, block_table: list[int], root: int, path: list[int],
                    block_size: int) -> None:
    """After verification: move the accepted nodes' K/V (at the slots of positions
    root + node) to positions root + 1 .. root + len(path), every layer at once, so that
    keeping positions up to root + len(path) keeps exactly the path. A node lies at or after
    its destination; all sources are read before any write."""
    moves = [(root + node, root + j) for j, node in enumerate(path, start=1) if node != j]
    if not moves:
        return
    bs = block_size

    def slots(ps):
        return torch.tensor([block_table[p // bs] * bs + p % bs for p in ps],
                            device=kv_cache.k.device)

    src, dst = slots([a for a, _ in moves]), slots([b for _, b in moves])
    kv_cache.k[:, dst] = kv_cache.k[:, src]
    if kv_cache.v.shape[-1]:
        kv_cache.v[:, dst] = kv_cache.v[:, src]
