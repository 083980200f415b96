"""Torch attention over the paged KV cache: the reference backend and the CPU path.

Decodes (one query token each) are batched: their context slots are gathered into one padded
[B, C, K, D] tensor and masked; GQA needs no repeat, as the G query heads sharing a KV head
ride in the query-length dimension. Prefill chunks run one sequence at a time: a chunk with no
earlier context attends its own K/V causally; a later chunk gathers its context from the cache.
On a CPU with avx512_bf16 and a bfloat16 cache, every prefill of a step instead goes to one
call of the C++ prefill kernel (cpu_kernels/prefill_attention.cpp), which reads each chunk's
context and its own K/V where they lie in the cache (3-5x torch's flash kernel per sequence
at 40-256 tokens); variant layers (window, softcap) keep the per-sequence path.

An fp8 cache (KVCache.is_fp8) holds e4m3 codes with a scale per KV head. Attention reads the
codes as they are and folds the scales into q (K's) and into the output (V's): a scale per
head commutes with both products, so no dequantized copy of the context is made. A fresh
prompt attends the codes it just stored, not its float K/V, so its output does not depend on
whether its keys came from this step or from the cache (prefix hits, chunking, preemption).

Deterministic mode (`deterministic=True`, the engine's --deterministic): every query token,
prefill or decode, is one row of the C++ paged kernel over the cache, attending positions
0 .. its own (its K/V is stored first). A row's result then depends on its position and the
cached K/V only: not on the batch, the chunk it came in or whether its context was computed
in this step or came from the prefix cache. Variants (window, softcap) and MLA are refused.

Two attention variants are taken per call (`supports_variants`): a sliding window (`window`
keys, a query's own included: key positions (q - window, q]) and tanh soft-capping of the
scores (Gemma 2). The C++ decode kernel takes both (its decodes are then the C++ decode
stack's, bit for bit); prefills with either run the gathered path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from servelm.attention.forward_batch import ForwardBatch
from servelm.attention.kv_cache import KVCache
from servelm.attention.paged_attention_cpu import (decode_kernel_for, mla_decode_kernel_for,
                                                  prefill_kernel_for)
from servelm.attention.tree_mask import apply_tree_masks


@dataclass
class TorchAttentionMetadata:
    decode_slots: torch.Tensor | None  # [Bd, C] context slots of each decode, padded
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, C] True where a slot is real
    # per prefill: context slots (None if fresh) and a [q, C] causal-with-offset mask; None
    # when the C++ prefill kernel takes the step's prefills (built on first use, if ever)
    prefill_slots: list[torch.Tensor | None] | None
    prefill_masks: list[torch.Tensor | None] | None
    # With the C++ decode kernel (paged_attention_cpu.py) instead of decode_slots/_mask:
    decode_tables: torch.Tensor | None = None  # [Bd, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # [Bd] int64
    # Sliding-window masks, built on first use per window size: window -> (decode, prefills)
    window_masks: dict = field(default_factory=dict)
    # With the C++ prefill kernel: every prefill of the step in one call (their tables,
    # query rows from 0 and cached positions before each chunk)
    prefill_tables: torch.Tensor | None = None  # [Bp, max_blocks]
    prefill_query_start: torch.Tensor | None = None  # [Bp + 1] int64
    prefill_context_lens: torch.Tensor | None = None  # [Bp] int64
    # Deterministic mode: one kernel row per query token (its table, positions + 1)
    row_tables: torch.Tensor | None = None  # [T, max_blocks]
    row_seq_lens: torch.Tensor | None = None  # [T] int64


class TorchAttentionBackend:
    name = "torch"
    supports_variants = True  # forward takes window= and softcap=
    supports_cuda_graphs = False  # decode metadata built per step (not over static buffers)

    def __init__(self, kv_cache: KVCache, num_heads: int, scale: float,
                 decode_kernel_mode: str | None = None):
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.scale = scale
        # CPU, fp32/bf16/fp8 cache: decodes read the paged blocks in place (C++); else None.
        # decode_kernel_mode: `--cpu-kernels attention=MODE`; None: the engine build's choice.
        self.decode_kernel = decode_kernel_for(kv_cache.k, decode_kernel_mode)
        # MLA caches: decodes through the C++ latent kernel where it applies
        self.mla_decode_kernel = (mla_decode_kernel_for(kv_cache.k, decode_kernel_mode)
                                  if kv_cache.is_mla else None)
        self.mla_kernel_calls = 0  # layers decoded by it (tests check it ran)
        self.deterministic = False
        self.deterministic_steps = 0  # forward calls on the per-row path (tests check it ran)
        # A chunk after cached context attends it without a [Q, C] mask (_prefill_after): CPU,
        # where torch has the flash kernel that returns log-sum-exps; not MLA (its own path).
        self.split_prefill = (_FLASH_CPU is not None and kv_cache.k.device.type == "cpu"
                              and not kv_cache.is_mla)
        self.split_prefill_calls = 0  # chunks that took it (tests check it ran)
        # CPU, bfloat16 cache, avx512_bf16: prompt chunks read the paged blocks in place (C++)
        self.prefill_kernel = (None if kv_cache.is_mla
                               else prefill_kernel_for(kv_cache.k, decode_kernel_mode))
        self.prefill_kernel_calls = 0  # layers whose prefills took it (tests check it ran)

    def set_deterministic(self) -> None:
        """Every token through the per-row kernel from now on (see the module doc)."""
        if self.decode_kernel is None:
            raise ValueError("deterministic mode needs servelm's C++ paged attention kernel "
                             "(CPU, float32/bfloat16/fp8 cache, head_dim a multiple of 16, "
                             "--cpu-kernels attention not 'torch')")
        self.deterministic = True

    def build_metadata(self, batch: ForwardBatch) -> TorchAttentionMetadata:
        if self.deterministic:
            return self._row_metadata(batch)
        bs = batch.block_size
        device = batch.slot_mapping.device
        nd = batch.num_decodes
        decode_slots = decode_mask = decode_tables = decode_seq_lens = None
        if nd and self.decode_kernel is not None:
            decode_tables = batch.block_tables[:nd]
            decode_seq_lens = torch.tensor(batch.seq_lens[:nd], dtype=torch.long)
        elif nd:
            max_len = max(batch.seq_lens[:nd])
            pos = torch.arange(max_len, device=device)
            tables = batch.block_tables[:nd, : -(-max_len // bs)]
            decode_slots = tables[:, pos // bs] * bs + pos % bs  # [Bd, C]
            lens = torch.tensor(batch.seq_lens[:nd], device=device)
            decode_mask = (pos[None, :] < lens[:, None])[:, None, None, :]
            decode_slots = decode_slots.masked_fill(~decode_mask[:, 0, 0], 0)
        meta = TorchAttentionMetadata(decode_slots, decode_mask, None, None, decode_tables,
                                      decode_seq_lens)
        if self.prefill_kernel is not None and batch.num_seqs > nd:
            # one kernel call takes every prefill; a variant layer builds the per-sequence
            # slots it needs on first use (_forward_variant)
            qsl = batch.query_start_loc
            meta.prefill_tables = batch.block_tables[nd:batch.num_seqs]
            meta.prefill_query_start = torch.tensor([x - qsl[nd] for x in qsl[nd:]],
                                                    dtype=torch.long)
            meta.prefill_context_lens = torch.tensor(batch.context_lens[nd:], dtype=torch.long)
        else:
            meta.prefill_slots, meta.prefill_masks = self._prefill_contexts(batch)
        if batch.tree_masks:  # speculative tree verification (attention/tree_mask.py)
            apply_tree_masks(self, batch, meta)
        return meta

    def _prefill_contexts(self, batch: ForwardBatch):
        """Per prefill: its context's slots (None for a fresh prompt) and its [Q, C] mask
        (None where the chunk needs none: fresh, or split_prefill)."""
        bs, device = batch.block_size, batch.slot_mapping.device
        prefill_slots, prefill_masks = [], []
        for i in range(batch.num_decodes, batch.num_seqs):
            ctx, total = batch.context_lens[i], batch.seq_lens[i]
            if ctx == 0:
                prefill_slots.append(None)
                prefill_masks.append(None)
                continue
            pos = torch.arange(total, device=device)
            prefill_slots.append(batch.block_tables[i, pos // bs] * bs + pos % bs)
            if self.split_prefill:  # no mask: at 128k keys one is Q x 128k bytes a chunk
                prefill_masks.append(None)
                continue
            q_pos = torch.arange(ctx, total, device=device)
            prefill_masks.append(pos[None, :] <= q_pos[:, None])
        return prefill_slots, prefill_masks

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, K, D] -> out: [T, H, D]. Writes k, v into the cache.

        window: attend only the last `window` positions (0: all); softcap: scores ->
        softcap * tanh(scores / softcap) before the softmax (0: off)."""
        if self.deterministic:
            return self._forward_rows(layer, q, k, v, batch, window, softcap)
        if window or softcap:
            return self._forward_variant(layer, q, k, v, batch, window, softcap)
        k_cache, v_cache = self.kv_cache.layer(layer)  # [num_slots, K, D]
        k, v = self.kv_cache.store(layer, batch.slot_mapping, k, v)  # as stored (fp8: codes)
        scales = self.kv_cache.layer_scales(layer)  # fp8: (k_scale[K], v_scale[K])
        meta: TorchAttentionMetadata = batch.attn_metadata
        nd = batch.num_decodes
        outs = []
        if nd:
            outs.append(self._decode(q[:nd], k_cache, v_cache, meta, *scales))
        qsl = batch.query_start_loc
        if meta.prefill_query_start is not None:
            self.prefill_kernel_calls += 1
            outs.append(self.prefill_kernel(
                q[qsl[nd]:], k_cache, v_cache, meta.prefill_tables, meta.prefill_query_start,
                meta.prefill_context_lens, self.kv_cache.block_size, self.scale).to(q.dtype))
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        for j, i in enumerate(range(nd, batch.num_seqs)):
            s, e = qsl[i], qsl[i + 1]
            slots = meta.prefill_slots[j]
            if slots is None:
                outs.append(self._prefill(q[s:e], k[s:e], v[s:e], None, *scales))
            elif meta.prefill_masks[j] is None:  # split_prefill: context, then the chunk
                ctx = slots[:slots.shape[0] - (e - s)]
                outs.append(self._prefill_after(q[s:e], _gather(k_cache, ctx),
                                                _gather(v_cache, ctx), k[s:e], v[s:e], *scales))
            else:
                outs.append(self._prefill(q[s:e], _gather(k_cache, slots), _gather(v_cache, slots),
                                          meta.prefill_masks[j], *scales))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # -- deterministic mode: one kernel row per query token ---------------------------------

    @staticmethod
    def _row_metadata(batch: ForwardBatch) -> TorchAttentionMetadata:
        qsl = batch.query_start_loc
        lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(batch.num_seqs)])
        tables = batch.block_tables[:batch.num_seqs].repeat_interleave(lens, dim=0)
        return TorchAttentionMetadata(None, None, [], [], row_tables=tables,
                                      row_seq_lens=batch.positions + 1)

    def _forward_rows(self, layer, q, k, v, batch: ForwardBatch, window: int,
                      softcap: float) -> torch.Tensor:
        if window or softcap:
            raise ValueError("deterministic mode does not support sliding-window or "
                             "soft-capped attention")
        k_cache, v_cache = self.kv_cache.layer(layer)
        self.kv_cache.store(layer, batch.slot_mapping, k, v)  # before any row reads them
        meta: TorchAttentionMetadata = batch.attn_metadata
        self.deterministic_steps += 1
        return self.decode_kernel(q, k_cache, v_cache, meta.row_tables, meta.row_seq_lens,
                                  self.kv_cache.block_size, self.scale,
                                  *self.kv_cache.layer_scales(layer)).to(q.dtype)

    def _decode(self, q, k_cache, v_cache, meta: TorchAttentionMetadata, k_scale=None,
                v_scale=None) -> torch.Tensor:
        if meta.decode_seq_lens is not None:  # the C++ kernel (fp8: with the head scales)
            return self.decode_kernel(q, k_cache, v_cache, meta.decode_tables,
                                      meta.decode_seq_lens, self.kv_cache.block_size,
                                      self.scale, k_scale, v_scale).to(q.dtype)
        bd, h, d = q.shape
        kh = k_cache.shape[1]
        keys = _gather(k_cache, meta.decode_slots).transpose(1, 2)  # [Bd, K, C, D]
        values = _gather(v_cache, meta.decode_slots).transpose(1, 2)
        q = q.view(bd, kh, h // kh, d)  # the G heads of a group share one KV head
        if k_scale is not None:
            q = q * k_scale.view(kh, 1, 1).to(q.dtype)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype),
                                             attn_mask=meta.decode_mask, scale=self.scale)
        if v_scale is not None:
            out = out * v_scale.view(kh, 1, 1).to(out.dtype)
        return out.reshape(bd, h, d)

    def _prefill(self, q, k, v, mask, k_scale=None, v_scale=None) -> torch.Tensor:
        # q: [Q, H, D]; k, v: [C, K, D]
        qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
        if k_scale is not None:  # per query head: the scale of the KV head it reads
            group = q.shape[1] // k.shape[1]
            qt = qt * k_scale.repeat_interleave(group).view(-1, 1, 1).to(q.dtype)
        # 4-D ([1, H, Q, D]): on the CPU, 3-D inputs take SDPA's math path; 4-D ones its
        # flash kernel, 2-4x faster for 100-1000 tokens.
        out = F.scaled_dot_product_attention(qt[None], kt[None], vt[None], attn_mask=mask,
                                             is_causal=mask is None, scale=self.scale,
                                             enable_gqa=True)[0]
        if v_scale is not None:
            group = q.shape[1] // k.shape[1]
            out = out * v_scale.repeat_interleave(group).view(-1, 1, 1).to(out.dtype)
        return out.transpose(0, 1)

    def _prefill_after(self, q, k_ctx, v_ctx, k, v, k_scale=None, v_scale=None):
        """A chunk after C cached positions, with no [Q, C + Q] mask: the chunk's queries
        attend the context (every key visible) and the chunk itself (causal) in two flash
        calls, and the two softmaxes are merged by their log-sum-exps l1, l2:

            out = (o1 e^l1 + o2 e^l2) / (e^l1 + e^l2)      (one softmax over all keys)

        q: [Q, H, D]; k_ctx, v_ctx: [C, K, D]; k, v: [Q, K, D] -> [Q, H, D]."""
        self.split_prefill_calls += 1
        group = q.shape[1] // k.shape[1]
        qt = q.transpose(0, 1)[None]  # [1, H, Q, D]
        if k_scale is not None:
            qt = qt * k_scale.repeat_interleave(group).view(-1, 1, 1).to(q.dtype)

        def heads(x):  # [N, K, D] -> [1, H, N, D] (the flash kernel takes no GQA)
            return x.to(q.dtype).transpose(0, 1).repeat_interleave(group, 0)[None]

        o1, l1 = _FLASH_CPU(qt, heads(k_ctx), heads(v_ctx), 0.0, False, scale=self.scale)[:2]
        o2, l2 = _FLASH_CPU(qt, heads(k), heads(v), 0.0, True, scale=self.scale)[:2]
        m = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
        out = ((o1.float() * w1 + o2.float() * w2) / (w1 + w2))[0].to(q.dtype)
        if v_scale is not None:
            out = out * v_scale.repeat_interleave(group).view(-1, 1, 1).to(out.dtype)
        return out.transpose(0, 1)

    # -- multi-head latent attention (MLA) --------------------------------------------------

    def forward_mla(self, layer: int, entry: torch.Tensor, batch: ForwardBatch,
                    q_decode: torch.Tensor, q_prefill: torch.Tensor, expand, scale: float,
                    latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA over a cache of [latent | rope key] entries (KVCache.is_mla).

        entry: [T, L+R], written at batch.slot_mapping. Decodes attend in latent space, as one
        KV head: q_decode [Td, H, L+R] (the key up-projection absorbed into q) against the
        entries, values the entries' latent part -> [Td, H, L] (the caller applies the value
        up-projection). Prefill chunks attend explicitly: expand(entries [C, L+R]) ->
        (k [C, H, Dk], v [C, H, Dv]) from the chunk's context and itself; q_prefill
        [Tp, H, Dk] -> [Tp, H, Dv]."""
        if self.deterministic:
            raise ValueError("deterministic mode does not support multi-head latent attention")
        cache = self.kv_cache.k[layer]  # [num_slots, 1, L+R]
        cache.index_copy_(0, batch.slot_mapping, entry.unsqueeze(1).to(cache.dtype))
        entry = entry.to(cache.dtype)
        meta: TorchAttentionMetadata = batch.attn_metadata
        nd = batch.num_decodes
        decode_out = q_decode.new_empty(0, q_decode.shape[1], latent_dim)
        if nd and self._mla_kernel_takes(q_decode, latent_dim):
            tables = batch.block_tables[:nd]
            lens = torch.tensor(batch.seq_lens[:nd], dtype=torch.long)
            decode_out = self.mla_decode_kernel(
                q_decode.contiguous(), cache.view(cache.shape[0], -1), tables, lens,
                self.kv_cache.block_size, scale, latent_dim).to(q_decode.dtype)
            self.mla_kernel_calls += 1
        elif nd:
            (slots, mask), _ = self._variant_masks(batch, meta, 0)
            keys = _gather(cache, slots).transpose(1, 2).to(q_decode.dtype)  # [Bd, 1, C, L+R]
            out = F.scaled_dot_product_attention(q_decode.unsqueeze(1), keys,
                                                 keys[..., :latent_dim], attn_mask=mask,
                                                 scale=scale)  # [Bd, 1, H, L]
            decode_out = out[:, 0]
        outs = []
        qsl = batch.query_start_loc
        for j, i in enumerate(range(nd, batch.num_seqs)):
            s, e = qsl[i] - qsl[nd], qsl[i + 1] - qsl[nd]
            ctx_slots = meta.prefill_slots[j]
            if ctx_slots is None:
                entries, mask = entry[qsl[i]:qsl[i + 1]], None
            else:
                entries, mask = _gather(cache, ctx_slots)[:, 0], meta.prefill_masks[j]
            k, v = expand(entries.to(q_prefill.dtype))
            out = F.scaled_dot_product_attention(
                q_prefill[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None],
                v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None, scale=scale)
            outs.append(out[0].transpose(0, 1))
        prefill_out = (torch.cat(outs) if outs else
                       q_prefill.new_empty(0, q_prefill.shape[1], 0))
        return decode_out, prefill_out

    def _mla_kernel_takes(self, q: torch.Tensor, latent_dim: int) -> bool:
        return (self.mla_decode_kernel is not None
                and q.dtype in (torch.float32, torch.bfloat16))

    # -- sliding window and soft-capping --------------------------------------------------

    def _forward_variant(self, layer, q, k, v, batch: ForwardBatch, window: int,
                         softcap: float) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.layer(layer)
        k, v = self.kv_cache.store(layer, batch.slot_mapping, k, v)
        k_scale, v_scale = self.kv_cache.layer_scales(layer)
        meta: TorchAttentionMetadata = batch.attn_metadata
        if meta.prefill_slots is None:  # the prefill kernel's step: this layer needs them
            meta.prefill_slots, meta.prefill_masks = self._prefill_contexts(batch)
        nd = batch.num_decodes
        kernel = nd and meta.decode_seq_lens is not None  # the C++ kernel takes the decodes
        decode_masks, prefill_masks = self._variant_masks(batch, meta, window, not kernel)
        outs = []
        if kernel:  # as the C++ decode stack runs them (runner/cpu_decode.py)
            outs.append(self.decode_kernel(
                q[:nd], k_cache, v_cache, meta.decode_tables, meta.decode_seq_lens,
                self.kv_cache.block_size, self.scale, k_scale, v_scale, window=window,
                softcap=softcap).to(q.dtype))
        elif nd:
            slots, mask = decode_masks
            bd, h, d = q[:nd].shape
            kh = k_cache.shape[1]
            keys = _gather(k_cache, slots).transpose(1, 2).to(q.dtype)  # [Bd, K, C, D]
            values = _gather(v_cache, slots).transpose(1, 2).to(q.dtype)
            qd = q[:nd].view(bd, kh, h // kh, d)
            if k_scale is not None:
                qd = qd * k_scale.view(kh, 1, 1).to(q.dtype)
            out = _attend(qd, keys, values, mask, self.scale, softcap)
            if v_scale is not None:
                out = out * v_scale.view(kh, 1, 1).to(out.dtype)
            outs.append(out.reshape(bd, h, d))
        qsl = batch.query_start_loc
        for j, i in enumerate(range(nd, batch.num_seqs)):
            s, e = qsl[i], qsl[i + 1]
            ctx_slots = meta.prefill_slots[j]
            if ctx_slots is None:
                kk, vv = k[s:e], v[s:e]
            else:
                kk, vv = _gather(k_cache, ctx_slots), _gather(v_cache, ctx_slots)
            outs.append(self._prefill_variant(q[s:e], kk, vv, prefill_masks[j], softcap,
                                              k_scale, v_scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _prefill_variant(self, q, k, v, mask, softcap, k_scale, v_scale) -> torch.Tensor:
        # q: [Q, H, D]; k, v: [C, K, D]; mask: [Q, C]
        group = q.shape[1] // k.shape[1]
        qt = q.transpose(0, 1)
        kt = k.transpose(0, 1).to(q.dtype).repeat_interleave(group, dim=0)  # [H, C, D]
        vt = v.transpose(0, 1).to(q.dtype).repeat_interleave(group, dim=0)
        if k_scale is not None:
            qt = qt * k_scale.repeat_interleave(group).view(-1, 1, 1).to(q.dtype)
        out = _attend(qt, kt, vt, mask, self.scale, softcap)
        if v_scale is not None:
            out = out * v_scale.repeat_interleave(group).view(-1, 1, 1).to(out.dtype)
        return out.transpose(0, 1)

    def _variant_masks(self, batch: ForwardBatch, meta: TorchAttentionMetadata, window: int,
                       decodes: bool = True):
        """((decode slots [Bd, C], decode mask [Bd, 1, 1, C]) or None, per-prefill [Q, C]
        masks): causal, and within `window` of the query when it is nonzero. decodes=False:
        no decode masks (the C++ kernel takes the decodes)."""
        if window in meta.window_masks:
            return meta.window_masks[window]
        bs, device, nd = batch.block_size, batch.slot_mapping.device, batch.num_decodes
        decode = None
        if nd and decodes:
            max_len = max(batch.seq_lens[:nd])
            pos = torch.arange(max_len, device=device)
            tables = batch.block_tables[:nd, : -(-max_len // bs)]
            slots = tables[:, pos // bs] * bs + pos % bs  # [Bd, C]
            lens = torch.tensor(batch.seq_lens[:nd], device=device)
            mask = pos[None, :] < lens[:, None]
            if window:
                mask &= pos[None, :] > lens[:, None] - 1 - window
            decode = (slots.masked_fill(~mask, 0), mask[:, None, None, :])
        prefills = []
        for i in range(nd, batch.num_seqs):
            ctx, total = batch.context_lens[i], batch.seq_lens[i]
            k_pos = torch.arange(total, device=device)  # a fresh chunk's keys are its own
            q_pos = torch.arange(ctx, total, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if window:
                mask &= k_pos[None, :] > q_pos[:, None] - window
            prefills.append(mask)
        meta.window_masks[window] = (decode, prefills)
        return decode, prefills


def _attend(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """q: [..., Q, D], k, v: [..., C, D] (same heads), mask: broadcastable [..., Q, C] bool."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


# (out [B, H, Q, D], logsumexp [B, H, Q], ...) = op(q, k, v, dropout_p, is_causal, scale=)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache: [num_slots, K, D]; slots: [...] -> [..., K, D].

    index_select over a [num_slots, K*D] view: on the CPU about 3x faster than advanced
    indexing (one contiguous row copy per slot)."""
    rows = cache.view(cache.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[1:])
