"""ModelRunner: ScheduledBatch -> ForwardBatch -> model -> sample -> StepResult.

Owns: the model, the KV cache tensors, the attention backend, per-sequence sampling
generators. Never: scheduling decisions (which sequences run, preemption, finishing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from servelm.config import CacheConfig, ModelConfig
from servelm.engine.scheduler import ScheduledBatch, ScheduledSeq
from servelm.protocol import Logprob
from servelm.runner.forward_batch import ForwardBatch
from servelm.runner.kv_cache import KVCache
from servelm.sampling import SamplingTensors, sample


@dataclass
class SampledToken:
    seq_id: int
    token_id: int
    logprob: Logprob | None = None


@dataclass
class StepResult:
    sampled: list[SampledToken]
    forward_s: float = 0.0  # wall time of model + sampling


CPU_DEFAULT_KV_BYTES = 2 * 2**30


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def num_kv_blocks(model_config: ModelConfig, cache_config: CacheConfig, dtype: torch.dtype,
                  device: torch.device) -> int:
    """Blocks that fit the KV memory budget (explicit bytes, or a fraction of free memory)."""
    if cache_config.num_blocks_override is not None:
        return cache_config.num_blocks_override
    budget = cache_config.kv_cache_memory_bytes
    if budget is None:
        budget = int(available_memory_bytes(device) * cache_config.memory_fraction)
        if device.type == "cpu":
            # Host memory is shared with everything else on the machine (as vLLM's CPU
            # backend, default to a few GiB rather than a share of all RAM).
            budget = min(budget, CPU_DEFAULT_KV_BYTES)
    per_block = KVCache.bytes_per_block(model_config, cache_config.block_size, dtype)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no block of "
                         f"{per_block} bytes; raise --kv-cache-memory")
    return int(blocks)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, kv_cache: KVCache,
                 backend, eos_token_ids: tuple[int, ...], device: torch.device, seed: int = 0,
                 graphs=None):
        self.model = model
        self.graphs = graphs  # a captured CudaGraphRunner for decode steps, or None
        self.config = model_config
        self.kv_cache = kv_cache
        self.backend = backend
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.block_size = kv_cache.block_size
        self._generators: dict[int, torch.Generator] = {}
        torch.manual_seed(seed)  # unseeded requests draw from the global stream

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        start = time.perf_counter()
        order = _decodes_first(batch.seqs)
        fb = self._build_forward_batch(order)
        hidden = self._forward(fb)
        sampling = [s for s in order if s.is_sampling]
        if not sampling:
            return StepResult([], time.perf_counter() - start)
        logits = self.model.compute_logits(hidden[fb.logits_indices]).float()
        out = sample(logits, self._sampling_tensors(sampling))
        result = self._to_step_result(sampling, out)
        result.forward_s = time.perf_counter() - start
        return result

    @torch.inference_mode()
    def score(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits at every computed position, decodes first as in execute: [T, V] (parity
        tests, perplexity). Writes the batch's K/V into the cache like a normal step."""
        fb = self._build_forward_batch(_decodes_first(batch.seqs))
        return self.model.compute_logits(self._forward(fb)).float()

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Replay a captured graph for a decode batch when one fits, else run eagerly."""
        hidden = self.graphs.maybe_run(fb) if self.graphs is not None else None
        if hidden is None:
            fb.attn_metadata = self.backend.build_metadata(fb)
            hidden = self.model(fb.input_ids, fb.positions, fb)
        return hidden

    def _build_forward_batch(self, order: list[ScheduledSeq]) -> ForwardBatch:
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        qsl, ctx_lens, seq_lens, logits_idx = [0], [], [], []
        num_decodes = 0
        for s in order:
            seq, end = s.seq, s.start + s.num_new_tokens
            input_ids += seq.token_ids[s.start:end]
            positions += range(s.start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(s.start, end)]
            qsl.append(qsl[-1] + s.num_new_tokens)
            ctx_lens.append(s.start)
            seq_lens.append(end)
            num_decodes += s.num_new_tokens == 1
            if s.is_sampling:
                logits_idx.append(qsl[-1] - 1)
        max_blocks = max(len(s.seq.block_table) for s in order)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in order]
        dev = self.device

        def t(x):
            return torch.tensor(x, dtype=torch.long, device=dev)

        return ForwardBatch(
            input_ids=t(input_ids), positions=t(positions), slot_mapping=t(slots),
            block_tables=t(tables), query_start_loc=qsl, context_lens=ctx_lens,
            seq_lens=seq_lens, num_decodes=num_decodes, block_size=bs,
            logits_indices=t(logits_idx),
        )

    def _generator(self, seq) -> torch.Generator | None:
        if seq.seed is None:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.seed)
            self._generators[seq.seq_id] = gen
        return gen

    def _sampling_tensors(self, sampling: list[ScheduledSeq]) -> SamplingTensors:
        seqs = [s.seq for s in sampling]
        params = [seq.params for seq in seqs]
        dev, vocab = self.device, self.config.vocab_size

        def col(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        st = SamplingTensors(temperatures=col([0.0 if p.is_greedy else p.temperature
                                               for p in params]))
        if not st.all_greedy:
            st.generators = [self._generator(seq) for seq in seqs]
            if any(p.top_k > 0 for p in params):
                st.top_ks = col([p.top_k if p.top_k > 0 else vocab for p in params], torch.long)
            if any(p.top_p < 1.0 for p in params):
                st.top_ps = col([p.top_p for p in params])
            if any(p.min_p > 0.0 for p in params):
                st.min_ps = col([p.min_p for p in params])
        if any(p.repetition_penalty != 1.0 for p in params):
            st.repetition_penalties = col([p.repetition_penalty for p in params])
            st.prompt_tokens = _pad([seq.token_ids[:seq.num_prompt_tokens] for seq in seqs],
                                    vocab, dev)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            st.presence_penalties = col([p.presence_penalty for p in params])
            st.frequency_penalties = col([p.frequency_penalty for p in params])
        if st.repetition_penalties is not None or st.presence_penalties is not None:
            st.output_tokens = _pad([seq.output_token_ids for seq in seqs], vocab, dev)
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                ids = list(seq.params.stop_token_ids)
                if not seq.params.ignore_eos:
                    ids += self.eos_token_ids
                if ids:
                    st.banned.append((row, ids))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        st.num_logprobs = max(wanted) if wanted else None
        return st

    def _to_step_result(self, sampling: list[ScheduledSeq], out) -> StepResult:
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        sampled = []
        for row, s in enumerate(sampling):
            lp = None
            k = s.seq.params.logprobs
            if k is not None and logprobs is not None:
                top = list(zip(top_ids[row][:k], top_lps[row][:k])) if top_ids else []
                lp = Logprob(token_ids[row], logprobs[row], top)
            sampled.append(SampledToken(s.seq.seq_id, token_ids[row], lp))
        return StepResult(sampled)


def _decodes_first(seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The attention backends take single-token sequences first (a stable sort)."""
    return sorted(seqs, key=lambda s: s.num_new_tokens != 1)


def _pad(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long,
                        device=device)
