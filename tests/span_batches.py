"""A ForwardBatch from (cached context, new tokens) spans, shared by the attention tests."""

import torch

from servelm.attention.forward_batch import ForwardBatch


def long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def batch_from_spans(spans: list[tuple[int, int]], block_size: int, free_blocks,
                     num_decodes: int) -> ForwardBatch:
    """One sequence per (context, new tokens) span, the first num_decodes of them decodes
    (one new token each); each takes its blocks in turn from free_blocks, an iterable of
    block ids (a scrambled order reaches blocks anywhere in the pool)."""
    free = iter(free_blocks)
    tables, slots, positions, qsl = [], [], [], [0]
    for ctx, n in spans:
        table = [next(free) for _ in range(-(-(ctx + n) // block_size))]
        tables.append(table)
        positions += range(ctx, ctx + n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n)]
        qsl.append(qsl[-1] + n)
    width = max(map(len, tables))
    return ForwardBatch(
        input_ids=long([0] * qsl[-1]), positions=long(positions), slot_mapping=long(slots),
        block_tables=long([r + [0] * (width - len(r)) for r in tables]), query_start_loc=qsl,
        context_lens=[c for c, _ in spans], seq_lens=[c + n for c, n in spans],
        num_decodes=num_decodes, block_size=block_size, logits_indices=long([0]))
