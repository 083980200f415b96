"""ModelRunner: StepDescription -> ForwardBatch -> model -> sample -> StepResult.

Owns: the model, the KV cache tensors, the attention backend, and its own state per sequence
(`RunnerSequence`: token ids, block table, sampling parameters and generator), built only
from the deltas of each StepDescription (servelm/core/contract.py).
Never: scheduling decisions (which sequences run, preemption, finishing), or reading the
engine's Sequence objects.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from servelm.attention import AttentionBackend
from servelm.attention.forward_batch import ForwardBatch
from servelm.attention.kv_cache import KVCache
from servelm.attention.tree_mask import compact_path_kv, node_depths, set_tree_rows
from servelm.config import CacheConfig, ModelConfig
from servelm.core.contract import (EXPERT_TOKENS_EVERY, KVBlock, PromptLogprobs, SampledToken,
                                   SpecOutcome, StepDescription, StepResult)
from servelm.core.runner_state import RunnerScheduled, RunnerState
from servelm.protocol import Logprob
from servelm.runner.cpu_decode import CpuDecodeStack
from servelm.runner.deterministic import enable_deterministic
from servelm.runner.logits import finish_logits, head_rows
from servelm.sampling import SamplingTensors, draw_tensors, sample, sampling_probs
from servelm.sampling.verify import (accept_greedy, accept_sampled, accept_tree_greedy,
                                     accept_tree_sampled)
from servelm.vision.runner import VisionRunner


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
                 backend: AttentionBackend, eos_token_ids: tuple[int, ...],
                 device: torch.device, seed: int = 0, graphs=None, proposer=None,
                 cpu_decode: str = "auto", grammars=None, lora=None,
                 deterministic: bool = False):
        self.model = model
        self.lora = lora  # servelm.lora.manager.LoraManager, or None (LoRA off)
        # A 16-bit head's near-maximum logits are recomputed in float32 (runner/logits.py).
        self._head_rows = head_rows(getattr(model, "language_model", model))
        from servelm.layers.moe import Experts

        self._experts = [m for m in model.modules() if isinstance(m, Experts)]
        self._steps_since_expert_tokens = 0
        self.grammars = grammars  # servelm.structured.GrammarMasks, or None (no tokenizer)
        self.proposer = proposer  # servelm.spec proposer, when speculating
        self.graphs = graphs  # a captured CudaGraphRunner for decode steps, or None
        self.config = model_config
        self.kv_cache = kv_cache
        self.backend = backend
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.block_size = kv_cache.block_size
        self._generators: dict[int, torch.Generator] = {}
        self._pooled: dict[int, torch.Tensor] = {}  # seq_id -> sum of prompt hidden states
        self.state = RunnerState(on_forget=self._forget)
        # Vision-language models: images encoded and placed per step (servelm/vision/runner.py)
        self.vision = (VisionRunner(model, model_config.vision, device, 16384)
                       if model_config.vision is not None else None)
        if self.vision is not None and deterministic:
            raise ValueError("--deterministic: vision-language models are not supported (the "
                             "encoder's kernels are not batch-invariant)")
        if self.vision is not None and getattr(proposer, "num_layers", None) is not None:
            raise ValueError("spec_draft_layers: vision-language models are not supported "
                             "(--speculative-method ngram is)")
        # --deterministic: batch-invariant linears and per-row attention (runner/
        # deterministic.py), before the decode stack is built from the model's layers.
        self.deterministic = deterministic
        if deterministic:
            enable_deterministic(model, model_config, backend, device, graphs)
        # CPU: all-decode steps in one C++ call (runner/cpu_decode.py), or None and why not
        # (logged where the model's layers are the reason). cpu_decode: its mode, the engine
        # option's `decode` part (auto | kernel | torch).
        # An EAGLE-3 proposer reads hidden states after some target layers: the C++ stack
        # returns them too (DecodeStack.run_aux); a graph does not, so with CUDA graphs the
        # target's steps then run eagerly.
        self.aux_layers = proposer.aux_layers if proposer is not None else ()
        self.cpu_stack, self.cpu_stack_refusal = (
            (None, "CUDA graphs") if graphs is not None else
            CpuDecodeStack.build(model, kv_cache, backend, mode=cpu_decode))
        torch.manual_seed(seed)  # unseeded requests draw from the global stream

    def _forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        if self.vision is not None:
            self.vision.forget(seq_id)
        self._pooled.pop(seq_id, None)
        if self.grammars is not None:
            self.grammars.forget(seq_id)
        if self.proposer is not None:
            self.proposer.release(seq_id)

    @torch.inference_mode()
    def execute(self, step: StepDescription) -> StepResult:
        start = time.perf_counter()
        if self.vision is not None:
            self._register_images(step)
        scheduled = self.state.apply(step)
        if self.lora is not None:
            self.lora.apply(step.lora)
        kv_saved = self._move_kv(step)
        if not scheduled:
            return StepResult([], kv_saved=kv_saved)
        proposals, draft_s = self._propose(scheduled)
        works = _decodes_first([_Work.of(s, proposals.get(s.seq.seq_id)) for s in scheduled])
        fb = build_forward_batch(works, self.block_size, self.device)
        for i, w in enumerate(works):  # speculative trees (attention/tree_mask.py)
            if w.parents is not None:
                set_tree_rows(fb, i, len(w.tokens) - len(w.drafts), w.parents)
        if self.vision is not None:
            self.vision.prepare(works, fb)
        if self.lora is not None:
            fb.lora = self.lora.batch_for(works, fb.query_start_loc)
        masks_job = self._start_masks(works)  # computed while the model runs
        hidden = self._forward(fb, works)
        masks = masks_job.result() if masks_job is not None else {}
        prompt_lps, embeddings = self._prompt_outputs(works, fb, hidden)
        if not fb.logits_indices.numel():
            return StepResult([], forward_s=time.perf_counter() - start, draft_s=draft_s,
                              prompt_logprobs=prompt_lps, embeddings=embeddings,
                              kv_saved=kv_saved)
        head_hidden = hidden[fb.logits_indices]
        logits, argmax = finish_logits(self.model.compute_logits(head_hidden), head_hidden,
                                       self._head_rows, self.config.final_logit_softcapping)
        rows = 0
        plain, spec = [], []
        for w in works:
            if w.drafts is not None:
                spec.append((w, rows))
                rows += len(w.drafts) + 1
            elif w.is_sampling:
                plain.append((w, rows))
                rows += 1
        sampled: list[SampledToken] = []
        if plain:
            idx = [r for _, r in plain]
            whole = len(idx) == rows
            plain_logits = logits if whole else logits[idx]
            plain_argmax = argmax if argmax is None or whole else argmax[idx]
            sched = [w.scheduled for w, _ in plain]
            out = sample(plain_logits, self._sampling_tensors(sched, masks), plain_argmax)
            sampled = self._sampled_tokens(sched, out)
        result = StepResult(sampled, {}, draft_s=draft_s, prompt_logprobs=prompt_lps,
                            embeddings=embeddings)
        if spec:
            self._verify(spec, logits, proposals, result, masks)
        self._report_expert_tokens(result)
        if self.vision is not None:
            result.num_images_encoded, result.num_encoder_cache_hits, result.encoder_s = \
                self.vision.last
        result.kv_saved = kv_saved
        result.forward_s = time.perf_counter() - start
        return result

    def _move_kv(self, step: StepDescription) -> list[KVBlock]:
        """The step's KV block reads, then its writes (before the forward: see
        StepDescription for why in this order)."""
        saved = [KVBlock(b, self.kv_cache.read_block(b)) for b in step.kv_saves]
        for block in step.kv_loads:
            self.kv_cache.write_block(block.block_id, block.data)
        return saved

    def _report_expert_tokens(self, result: StepResult) -> None:
        """Every EXPERT_TOKENS_EVERY steps, the MoE layers' cumulative tokens per expert."""
        if not self._experts:
            return
        self._steps_since_expert_tokens += 1
        if self._steps_since_expert_tokens >= EXPERT_TOKENS_EVERY:
            self._steps_since_expert_tokens = 0
            result.expert_tokens = [m.num_routed_tokens.tolist() for m in self._experts]

    def _propose(self, scheduled: list[RunnerScheduled]) -> tuple[dict, float]:
        asks = [s for s in scheduled if s.num_spec]
        if not asks or self.proposer is None:
            return {}, 0.0
        t0 = time.perf_counter()
        proposals = self.proposer.propose(asks)
        return proposals, time.perf_counter() - t0

    def _prompt_outputs(self, works: list, fb: ForwardBatch, hidden: torch.Tensor):
        """Per sequence that asked: this chunk's prompt logprobs, and (at the prompt's last
        chunk) its pooled hidden state (mean over the prompt, or the last position's)."""
        prompt_lps: dict[int, PromptLogprobs] = {}
        embeddings: dict[int, list[float]] = {}
        qsl = fb.query_start_loc
        for i, w in enumerate(works):
            params, seq = w.seq.params, w.seq
            if (params.prompt_logprobs is None and params.pooling is None) \
                    or w.start >= seq.num_prompt_tokens:
                continue
            end = min(w.start + len(w.tokens), seq.num_prompt_tokens)
            rows = hidden[qsl[i]:qsl[i] + end - w.start]  # prompt positions start .. end-1
            if params.prompt_logprobs is not None:
                prompt_lps[seq.seq_id] = self._prompt_logprobs(seq, w.start, end, rows)
            if params.pooling == "mean":
                total = rows.float().sum(dim=0)
                if seq.seq_id in self._pooled:
                    total += self._pooled[seq.seq_id]
                self._pooled[seq.seq_id] = total
            if params.pooling is not None and end == seq.num_prompt_tokens:
                pooled = (self._pooled.pop(seq.seq_id) / seq.num_prompt_tokens
                          if params.pooling == "mean" else rows[-1].float())
                embeddings[seq.seq_id] = pooled.tolist()
        return prompt_lps, embeddings

    def _prompt_logprobs(self, seq, start: int, end: int, rows: torch.Tensor):
        """Position p's distribution scores prompt token p + 1 (the last prompt position
        scores the first output token: not a prompt logprob)."""
        num = min(end, seq.num_prompt_tokens - 1) - start
        if num <= 0:
            return PromptLogprobs(start, [])
        lps = torch.log_softmax(self.model.compute_logits(rows[:num]).float(), dim=-1)
        targets = torch.tensor(seq.token_ids[start + 1:start + 1 + num], device=lps.device)
        chosen = lps.gather(1, targets[:, None]).squeeze(1).tolist()
        k = seq.params.prompt_logprobs
        top_ids = top_lps = None
        if k:
            top_lps, top_ids = lps.topk(k, dim=-1)
            top_lps, top_ids = top_lps.tolist(), top_ids.tolist()
        out = [Logprob(int(t), lp, list(zip(top_ids[j], top_lps[j])) if k else [])
               for j, (t, lp) in enumerate(zip(targets.tolist(), chosen))]
        return PromptLogprobs(start, out)

    def _start_masks(self, works: list):
        if self.grammars is None:
            return None
        return self.grammars.start([(w.seq, w.drafts or []) for w in works
                                    if w.drafts is not None or w.is_sampling])

    def _verify(self, spec: list, logits: torch.Tensor, proposals: dict,
                result: StepResult, masks: dict) -> None:
        """Accept or reject each sequence's drafts (servelm/sampling/verify.py). A structured
        sequence's rows are masked first (row i: the grammar after its first i drafts), so a
        draft the grammar forbids has target probability 0 and is rejected."""
        greedy_rows, sampled = [], []
        for w, row in spec:
            n = len(w.drafts) + 1
            mask = masks.get(w.seq.seq_id)
            if mask is not None:
                logits[row:row + n].masked_fill_(
                    torch.from_numpy(~mask).to(logits.device), float("-inf"))
            if w.seq.params.is_greedy:
                greedy_rows.append((w, row, n))
            else:
                sampled.append((w, row, n))
        emitted: dict[int, list[int]] = {}
        paths: dict[int, list[int]] = {}  # trees: the accepted nodes
        if greedy_rows:
            argmax = logits.argmax(dim=-1).tolist()
            for w, row, n in greedy_rows:
                if w.parents is not None:
                    emitted[w.seq.seq_id], paths[w.seq.seq_id] = accept_tree_greedy(
                        w.drafts, w.parents, argmax[row:row + n])
                    continue
                emitted[w.seq.seq_id] = accept_greedy(w.drafts, argmax[row:row + n])
        if sampled:
            idx = torch.tensor([r for _, row, n in sampled for r in range(row, row + n)],
                               device=logits.device)
            rows_params = [w.seq.params for w, _, n in sampled for _ in range(n)]
            probs = sampling_probs(logits[idx], draw_tensors(rows_params, self.config.vocab_size,
                                                              self.device))
            at = 0
            for w, _, n in sampled:
                q = proposals[w.seq.seq_id].probs
                if w.parents is not None:
                    emitted[w.seq.seq_id], paths[w.seq.seq_id] = accept_tree_sampled(
                        w.drafts, w.parents, probs[at:at + n])
                else:
                    emitted[w.seq.seq_id] = accept_sampled(w.drafts, probs[at:at + n], q)
                at += n
        for w, _ in spec:
            if w.seq.seq_id in paths:  # keep the path's KV where rollback keeps KV
                compact_path_kv(self.kv_cache, w.seq.block_table,
                                w.start + len(w.tokens) - len(w.drafts) - 1,
                                paths[w.seq.seq_id], self.block_size)
            tokens = emitted[w.seq.seq_id]
            depth = max(node_depths(w.parents)) if w.parents is not None else 0
            result.spec[w.seq.seq_id] = SpecOutcome(len(w.drafts), len(tokens) - 1, depth)
            result.sampled += [SampledToken(w.seq.seq_id, t) for t in tokens]

    @torch.inference_mode()
    def score(self, items: list[RunnerScheduled]) -> torch.Tensor:
        """Logits at every computed position of `items` (see score_item), decodes first as in
        execute: [T, V] (parity tests, perplexity). Writes their K/V into the cache like a
        step; outside the step path, so it touches no sequence the runner tracks."""
        fb = self._build_forward_batch(items)
        if self.vision is not None:
            self.vision.prepare(_decodes_first([_Work.of(s) for s in items]), fb)
        return self.model.compute_logits(self._forward(fb)).float()

    def _register_images(self, step: StepDescription) -> None:
        for s in step.seqs:
            if s.new is not None and s.new.images:
                self.vision.register(s.seq_id, s.new.images, s.new.num_prompt_tokens)

    def _forward(self, fb: ForwardBatch, works: list | None = None) -> torch.Tensor:
        """Replay a captured graph for a decode batch when one fits (CUDA), or run it as one
        C++ call (CPU), else run eagerly. A step with LoRA rows runs eagerly with the
        adapters' products added (servelm/lora/manager.py). With a proposer reading aux
        layers, a step's (`works`) hidden states there go to it."""
        if fb.lora is not None:
            return self.lora.forward(self.model, self.backend, fb)
        # image rows and M-RoPE positions are not in a captured graph: those steps run eagerly
        hidden = (self.graphs.maybe_run(fb) if self.graphs is not None and fb.mm is None
                  else None)
        # a tree's rows attend their ancestors, not contiguous positions: eagerly
        stack = self.cpu_stack if hidden is None and not fb.tree_masks else None
        if stack is not None and self.aux_layers:
            ran = stack.maybe_run(fb, aux_layers=self.aux_layers)
            if ran is not None:
                hidden, aux = ran
                if works is not None:
                    self.proposer.observe(works, fb.query_start_loc, aux)
        elif stack is not None:
            hidden = stack.maybe_run(fb)
        if hidden is None:
            fb.attn_metadata = self.backend.build_metadata(fb)
            if self.aux_layers:
                hidden, aux = self.model(fb.input_ids, fb.positions, fb,
                                         aux_layers=self.aux_layers)
                if works is not None:
                    self.proposer.observe(works, fb.query_start_loc, aux)
            else:
                hidden = self.model(fb.input_ids, fb.positions, fb)
        return hidden

    def _build_forward_batch(self, seqs: list[RunnerScheduled]) -> ForwardBatch:
        works = _decodes_first([_Work.of(s) for s in seqs])
        return build_forward_batch(works, self.block_size, self.device)

    def _generator(self, seq) -> torch.Generator | None:
        if seq.seed is None:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.seed)
            self._generators[seq.seq_id] = gen
        return gen

    def _sampling_tensors(self, sampling: list[RunnerScheduled],
                          masks: dict | None = None) -> SamplingTensors:
        seqs = [s.seq for s in sampling]
        params = [seq.params for seq in seqs]
        dev, vocab = self.device, self.config.vocab_size

        def col(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        st = draw_tensors(params, vocab, dev)
        if not st.all_greedy:
            st.generators = [self._generator(seq) for seq in seqs]
        if any(p.repetition_penalty != 1.0 for p in params):
            st.repetition_penalties = col([p.repetition_penalty for p in params])
            st.prompt_tokens = _pad([seq.token_ids[:seq.num_prompt_tokens] for seq in seqs],
                                    vocab, dev)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            st.presence_penalties = col([p.presence_penalty for p in params])
            st.frequency_penalties = col([p.frequency_penalty for p in params])
        if st.repetition_penalties is not None or st.presence_penalties is not None:
            st.output_tokens = _pad([seq.output_token_ids for seq in seqs], vocab, dev)
        allowed = self._allowed(seqs, masks or {})
        masks = masks or {}
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                ids = list(seq.params.stop_token_ids)
                if not seq.params.ignore_eos:
                    ids += self.eos_token_ids
                if ids and allowed is not None and seq.seq_id in masks:
                    # Within the grammar; once it allows only an end, the end wins.
                    kept = allowed[row].clone()
                    kept[ids] = False
                    if kept.any():
                        allowed[row] = kept
                elif ids:
                    st.banned.append((row, ids))
            bad = _bad_word_bans(seq)
            if bad:
                st.banned.append((row, bad))
            if seq.params.logit_bias:
                ids, values = zip(*seq.params.logit_bias.items())
                st.biases.append((row, list(ids), list(values)))
        st.allowed = allowed
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        st.num_logprobs = max(wanted) if wanted else None
        return st

    def _allowed(self, seqs: list, masks: dict) -> torch.Tensor | None:
        """[B, V] bool of the tokens each row may draw (grammar masks and allowed_token_ids),
        or None when every row may draw any. Built in numpy (host), moved once."""
        if not masks and all(seq.params.allowed_token_ids is None for seq in seqs):
            return None
        allowed = np.ones((len(seqs), self.config.vocab_size), dtype=bool)
        for row, seq in enumerate(seqs):
            if seq.seq_id in masks:
                allowed[row] = masks[seq.seq_id][0]
            only = seq.params.allowed_token_ids
            if only is not None:
                keep = np.zeros(self.config.vocab_size, dtype=bool)
                keep[only] = True
                allowed[row] &= keep
                if not allowed[row].any():  # the grammar and the list share nothing
                    allowed[row] = keep
        return torch.from_numpy(allowed).to(self.device)

    def _sampled_tokens(self, sampling: list[RunnerScheduled], out) -> list[SampledToken]:
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
        return sampled


@dataclass
class _Work:
    """What one sequence computes this step: its input tokens from `start` (the scheduled
    ones, plus the drafts to verify), and which positions need logits."""

    scheduled: RunnerScheduled
    tokens: list[int]
    drafts: list[int] | None = None  # speculating: every position is scored
    parents: list[int] | None = None  # the drafts are a tree (Proposal.parents)

    @classmethod
    def of(cls, s: RunnerScheduled, proposal=None) -> _Work:
        n = s.num_new_tokens - s.num_spec
        tokens = s.seq.token_ids[s.start:s.start + n]
        if proposal is not None and proposal.token_ids:
            return cls(s, tokens + proposal.token_ids, list(proposal.token_ids),
                       proposal.parents)
        return cls(s, tokens)

    @property
    def seq(self):
        return self.scheduled.seq

    @property
    def start(self) -> int:
        return self.scheduled.start

    @property
    def is_sampling(self) -> bool:
        return self.scheduled.is_sampling


def build_forward_batch(works: list, block_size: int, device) -> ForwardBatch:
    """Flatten works (each: .seq, .start, .tokens, .drafts, .is_sampling) into one batch.
    Logits are taken at the last position of a sampling sequence, at every position of a
    speculating one."""
    bs = block_size
    input_ids, positions, slots = [], [], []
    qsl, ctx_lens, seq_lens, logits_idx = [0], [], [], []
    num_decodes = 0
    for w in works:
        seq, n = w.seq, len(w.tokens)
        end = w.start + n
        input_ids += w.tokens
        positions += range(w.start, end)
        table = seq.block_table
        slots += [table[p // bs] * bs + p % bs for p in range(w.start, end)]
        qsl.append(qsl[-1] + n)
        ctx_lens.append(w.start)
        seq_lens.append(end)
        num_decodes += n == 1
        if w.drafts is not None:
            logits_idx += range(qsl[-2], qsl[-1])
        elif w.is_sampling:
            logits_idx.append(qsl[-1] - 1)
    max_blocks = max(len(w.seq.block_table) for w in works)
    tables = [w.seq.block_table + [0] * (max_blocks - len(w.seq.block_table)) for w in works]

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    return ForwardBatch(
        input_ids=t(input_ids), positions=t(positions), slot_mapping=t(slots),
        block_tables=t(tables), query_start_loc=qsl, context_lens=ctx_lens,
        seq_lens=seq_lens, num_decodes=num_decodes, block_size=bs,
        logits_indices=t(logits_idx),
    )


def _bad_word_bans(seq) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far (a one-token
    word is always banned)."""
    words = seq.params.bad_words_token_ids
    if not words:
        return []
    out = seq.output_token_ids
    bans = []
    for word in words:
        head = word[:-1]
        if not head or (len(out) >= len(head) and out[len(out) - len(head):] == head):
            bans.append(word[-1])
    return bans


def _decodes_first(works: list) -> list:
    """The attention backends take single-token sequences first (a stable sort)."""
    return sorted(works, key=lambda w: len(w.tokens) != 1)


def _pad(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long,
                        device=device)
