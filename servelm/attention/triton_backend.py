"""Triton attention over the paged KV cache: the GPU path (and, interpreted, a CPU check).

Per layer and step: store_kv writes the new K/V into their slots; decodes (the first
`num_decodes` sequences, one query each) go to the split-K decode kernel; prefill chunks go to
the paged prefill/extend kernel, which reads cached prefix and new keys through the block table.
MLA models (`forward_mla`) decode through the same split-K kernel in latent space.

    q: [T, H, D] = [ decode tokens (Bd) | prefill chunk tokens (Tp) ]
    metadata (built once per step, shared by every layer):
        block_tables [B, max_blocks] int32, seq_lens [B] int32,
        prefill_query_start_loc [Bp + 1] int32 (rebased to the first prefill token)

Decode-only metadata can also be built over a CUDA graph's static buffers (`decode_metadata`),
so `forward` reads nothing but tensors and a few ints fixed at capture time.

Deterministic mode (`set_deterministic`, the engine's --deterministic): every query token,
prefill chunks and draft rows included, is one row of the decode kernel with batch-invariant
splits of DETERMINISTIC_SPLIT_LEN keys, reading keys 0 .. its own position:

    chunk of seq i: tokens at positions c .. c+n-1  ->  n rows, block table i each,
                                                         seq_lens c+1 .. c+n

so a token's attention is the same bits whether it came in a prefill chunk (of any size),
as a decode, beside any batch, or after a prefix-cache hit.

Owns the metadata and the kernel dispatch. Never: imported unless chosen (it imports triton);
touches scheduling, sampling or model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from servelm.attention.forward_batch import ForwardBatch
from servelm.attention.kv_cache import KVCache
from servelm.kernels.decode_attention import (choose_num_splits, decode_attention,
                                              fixed_num_splits)
from servelm.kernels.prefill_attention import prefill_attention
from servelm.kernels.store_kv import store_kv


DETERMINISTIC_SPLIT_LEN = 256  # keys per split in deterministic mode (a multiple of block_n)


@dataclass
class TritonAttentionMetadata:
    num_decodes: int
    num_kv_splits: int  # decode splits; fixed per CUDA graph
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [Bd] int32
    prefill_block_tables: torch.Tensor | None = None  # [Bp, max_blocks] int32
    prefill_seq_lens: torch.Tensor | None = None  # [Bp] int32
    prefill_query_start_loc: torch.Tensor | None = None  # [Bp + 1] int32, from 0
    max_prefill_query_len: int = 0


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True
    supports_variants = False  # no sliding window or soft-cap kernels yet
    decode_kernel = None  # no C++ decode kernel: the CPU decode stack does not apply

    def __init__(self, kv_cache: KVCache, num_heads: int, scale: float):
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = kv_cache.k.shape[2]
        self.scale = scale
        device = kv_cache.k.device
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 132)
        self.split_len = 0  # > 0: deterministic mode's fixed splits
        self.deterministic_steps = 0  # forward calls on the per-row path (tests check it ran)

    @property
    def deterministic(self) -> bool:
        return self.split_len > 0

    def set_deterministic(self) -> None:
        """Every token one row of the decode kernel with fixed splits (module doc)."""
        self.split_len = DETERMINISTIC_SPLIT_LEN

    def build_metadata(self, batch: ForwardBatch) -> TritonAttentionMetadata:
        if self.deterministic:
            return self._row_metadata(batch)
        device = batch.slot_mapping.device
        nd = batch.num_decodes
        tables = batch.block_tables.to(torch.int32)
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=device)
        splits = self.num_kv_splits(nd, max(batch.seq_lens[:nd], default=1))
        meta = self.decode_metadata(tables[:nd], seq_lens[:nd], splits)
        if nd < batch.num_seqs:
            qsl = batch.query_start_loc
            rebased = [x - qsl[nd] for x in qsl[nd:]]
            meta.prefill_block_tables = tables[nd:]
            meta.prefill_seq_lens = seq_lens[nd:]
            meta.prefill_query_start_loc = torch.tensor(rebased, dtype=torch.int32,
                                                        device=device)
            meta.max_prefill_query_len = max(b - a for a, b in pairwise(rebased))
        return meta

    def _row_metadata(self, batch: ForwardBatch) -> TritonAttentionMetadata:
        """Deterministic mode: one decode row per query token (module doc)."""
        device = batch.slot_mapping.device
        query_lens = [b - a for a, b in pairwise(batch.query_start_loc)]
        seq_lens = [c + j + 1 for c, n in zip(batch.context_lens, query_lens) for j in range(n)]
        rows = torch.repeat_interleave(torch.arange(batch.num_seqs),
                                       torch.tensor(query_lens, dtype=torch.long))
        tables = batch.block_tables.to(torch.int32)[rows.to(batch.block_tables.device)]
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        splits = fixed_num_splits(max(seq_lens, default=1), self.split_len)
        return self.decode_metadata(tables, lens, splits)

    def num_kv_splits(self, num_decodes: int, max_seq_len: int) -> int:
        return choose_num_splits(num_decodes, self.num_kv_heads, max_seq_len, self.num_sms)

    @staticmethod
    def decode_metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        num_kv_splits: int) -> TritonAttentionMetadata:
        """Metadata for a batch of decodes only; the tensors are used as given (not copied),
        so a CUDA graph can pass views of its static buffers."""
        nd = seq_lens.shape[0]
        return TritonAttentionMetadata(nd, num_kv_splits, block_tables if nd else None,
                                       seq_lens if nd else None)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, K, D] -> out: [T, H, D]. Writes k, v into the cache.
        window, softcap: not implemented (supports_variants is False)."""
        if window or softcap:
            raise ValueError("attention backend 'triton' implements neither sliding_window nor "
                             "attn_logit_softcapping; use attention_backend 'torch'")
        k_cache, v_cache = self.kv_cache.layer(layer)  # [num_slots, K, D]
        k_scale, v_scale = self.kv_cache.layer_scales(layer)  # fp8 cache: [K] each, else None
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        meta: TritonAttentionMetadata = batch.attn_metadata
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd, bs = meta.num_decodes, self.kv_cache.block_size
        if nd:
            decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                             meta.decode_seq_lens, bs, self.scale, meta.num_kv_splits,
                             out=out[:nd], k_scale=k_scale, v_scale=v_scale,
                             split_len=self.split_len)
            self.deterministic_steps += self.deterministic
        if meta.prefill_seq_lens is not None:
            prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                              meta.prefill_query_start_loc, meta.prefill_seq_lens,
                              meta.max_prefill_query_len, bs, self.scale, out=out[nd:],
                              k_scale=k_scale, v_scale=v_scale)
        return out

    # -- multi-head latent attention (MLA) --------------------------------------------------

    def forward_mla(self, layer: int, entry: torch.Tensor, batch: ForwardBatch,
                    q_decode: torch.Tensor, q_prefill: torch.Tensor, expand, scale: float,
                    latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA over a cache of [latent | rope key] entries, as the torch backend's
        forward_mla (same arguments and results). Decodes run the split-K decode kernel with
        one KV head of L+R dims and the cache as both keys and values: the first L output
        dims are the softmax-weighted latents (the last R, the rope keys' sum, are dropped;
        R/(L+R) of the value work is wasted, 11% for DeepSeek-V3). Prefill chunks expand
        their context to per-head keys and values and attend explicitly (torch SDPA)."""
        if self.deterministic:
            raise ValueError("deterministic mode does not support multi-head latent attention")
        cache = self.kv_cache.k[layer]  # [num_slots, 1, L+R]
        cache[batch.slot_mapping.long(), 0] = entry.to(cache.dtype)
        meta: TritonAttentionMetadata = batch.attn_metadata
        nd, bs = meta.num_decodes, self.kv_cache.block_size
        decode_out = q_decode.new_empty(0, q_decode.shape[1], latent_dim)
        if nd:
            q = q_decode.to(cache.dtype).contiguous()
            full = decode_attention(q, cache, cache, meta.decode_block_tables,
                                    meta.decode_seq_lens, bs, scale, meta.num_kv_splits)
            decode_out = full[..., :latent_dim].to(q_decode.dtype)
        outs = []
        if meta.prefill_seq_lens is not None:
            qsl = meta.prefill_query_start_loc.tolist()
            for j, seq_len in enumerate(meta.prefill_seq_lens.tolist()):
                s, e = qsl[j], qsl[j + 1]
                pos = torch.arange(seq_len, device=cache.device)
                blocks = meta.prefill_block_tables[j].long()[pos // bs]
                entries = cache[blocks * bs + pos % bs, 0].to(q_prefill.dtype)  # [C, L+R]
                k, v = expand(entries)
                n = e - s  # this chunk's queries are the last n of the seq_len positions
                mask = (torch.arange(seq_len, device=cache.device)[None, :]
                        <= torch.arange(seq_len - n, seq_len, device=cache.device)[:, None])
                out = torch.nn.functional.scaled_dot_product_attention(
                    q_prefill[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None],
                    v.transpose(0, 1)[None], attn_mask=mask, scale=scale)
                outs.append(out[0].transpose(0, 1))
        prefill_out = (torch.cat(outs) if outs else
                       q_prefill.new_empty(0, q_prefill.shape[1], 0))
        return decode_out, prefill_out
