"""Engine: requests in, token deltas out, one scheduling step at a time.

Owns: admission (reject at once what can never fit), the request -> sequences map, turning
each scheduled batch into a StepDescription (deltas against what the runner already knows,
servelm/core/contract.py), the update step (append sampled tokens, detokenize, decide every
finish: EOS, stop token, stop string, length, abort) and freeing finished sequences.
Never: tensors, or handing the runner a pointer into its state; the runner it is given (any
`Runner`) does the math, so the simulator can drive this same code with a modelled runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from servelm.config import SchedulerConfig
from servelm.cost import attention_pairs
from servelm.core.contract import (KVBlock, KVEvent, NewSequence, Runner, ScheduledSequence,
                                   StepDescription, StepReport, StepResult)
from servelm.engine.block_manager import BlockManager
from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.engine.kv_connector import KVConnector, NoKVConnector, StepKVWorker
from servelm.engine.scheduler import ScheduledBatch, Scheduler
from servelm.engine.slo_policy import make_scheduling_policy
from servelm.engine.sequence import Sequence, SequenceStatus
from servelm.engine.thinking_budget import ThinkingSteer
from servelm.vision.budget import check_images
from servelm.protocol import (
    EngineRequest,
    FinishReason,
    InvalidParameterError,
    Logprob,
    RequestTimings,
    TokenDelta,
)


@dataclass
class _RequestState:
    request: EngineRequest
    seqs: list[Sequence]
    timings: RequestTimings
    detokenizers: dict[int, IncrementalDetokenizer | None]
    num_unfinished: int


@dataclass
class _RunnerView:
    """What the runner has been told about one sequence."""

    num_tokens: int = 0
    num_blocks: int = 0  # length of the block table it holds


@dataclass
class EngineStats:
    num_steps: int = 0
    last_step_s: float = 0.0
    last_num_seqs: int = 0
    last_num_tokens: int = 0
    num_prompt_tokens: int = 0  # prompt tokens admitted
    num_generated_tokens: int = 0
    num_computed_tokens: int = 0  # tokens the model ran (prefill + decode, recompute too)
    num_computed_prompt_tokens: int = 0  # of which at prompt positions
    # For bandwidth/FLOP estimates of the last step (server metrics):
    last_num_context_tokens: int = 0  # KV positions the step attended over (sum of seq lens)
    last_num_attention_pairs: int = 0  # causal (query, key) pairs: servelm.cost.attention_pairs
    last_num_decode_tokens: int = 0  # of last_num_tokens: plain one-token decodes
    last_num_verify_tokens: int = 0  # speculative verifications (1 + drafts each)
    last_num_prefill_tokens: int = 0  # prompt (or recompute) chunks
    last_max_prefill_chunk: int = 0  # of which the largest one sequence's (the doctor)
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    # Speculative decoding (zero when off):
    spec_num_verifications: int = 0  # sequence-steps that verified drafts (or asked for them)
    spec_num_proposed: int = 0  # draft tokens scored by the target
    spec_num_accepted: int = 0  # of which accepted
    spec_draft_s: float = 0.0  # time in the proposer
    spec_step_s: float = 0.0  # time of the steps that speculated
    # [n]: verifications that accepted n drafts; per draft position i + 1, verifications that
    # tried it (every draft before it accepted) and that accepted it
    spec_accepted_lengths: list[int] = field(default_factory=list)
    spec_position_tried: list[int] = field(default_factory=list)
    spec_position_accepted: list[int] = field(default_factory=list)
    # Vision encoder (zero for text-only models): images encoded, cache hits, seconds
    num_images_encoded: int = 0
    num_encoder_cache_hits: int = 0
    encoder_time_s: float = 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted / self.spec_num_proposed if self.spec_num_proposed else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verifying sequence-step: accepted drafts + the target's one."""
        n = self.spec_num_verifications
        return (self.spec_num_accepted + n) / n if n else 0.0

    @property
    def spec_draft_time_share(self) -> float:
        return self.spec_draft_s / self.spec_step_s if self.spec_step_s else 0.0

    @property
    def spec_position_acceptance(self) -> list[float]:
        return [a / t if t else 0.0
                for a, t in zip(self.spec_position_accepted, self.spec_position_tried)]

    def count_acceptance(self, num_accepted: int, depth: int) -> None:
        """One verification's accepted drafts, of `depth` positions it could accept."""
        _bump(self.spec_accepted_lengths, num_accepted)
        for i in range(min(num_accepted + 1, depth)):
            _bump(self.spec_position_tried, i)
        for i in range(num_accepted):
            _bump(self.spec_position_accepted, i)


def _bump(counts: list[int], i: int) -> None:
    if len(counts) <= i:
        counts.extend([0] * (i + 1 - len(counts)))
    counts[i] += 1


class Engine:
    def __init__(self, runner: Runner, tokenizer, block_manager: BlockManager,
                 scheduler_config: SchedulerConfig, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], model_name: str = "", speculator=None,
                 clock: Callable[[], float] = time.monotonic, loras=None,
                 kv_connector: KVConnector | None = None):
        self.runner = runner
        self.clock = clock  # every timestamp the engine takes (a simulator's virtual clock)
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        if not scheduler_config.enable_chunked_prefill:
            # Unchunked, a whole sequence (after preemption: prompt + output) must fit one
            # step's budget, so the budget bounds the context.
            max_model_len = min(max_model_len, scheduler_config.max_num_batched_tokens)
        self.max_model_len = max_model_len
        self.speculator = speculator  # servelm.spec.SpecController, or None
        # LoRA adapters and slots (servelm/lora/slots.py LoraSlots), or None: LoRA off.
        self.loras = loras
        # KV entering or leaving the pool (servelm/engine/kv_connector.py): disaggregation's
        # transfers, the host/disk tiers, or both; NoKVConnector: none.
        self.kv_connector = kv_connector or NoKVConnector()
        self.kv_worker = StepKVWorker(self.execute_kv)
        self.scheduler = Scheduler(scheduler_config, block_manager, speculator, max_model_len,
                                   loras, self.kv_connector)
        # --scheduling-policy (servelm/engine/slo_policy.py); its step-time model, if any, is
        # set by whoever built the engine (engine_builder, the simulator).
        self.scheduler.policy = make_scheduling_policy(scheduler_config.scheduling_policy, clock)
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.model_name = model_name
        # Vision-language models: the placeholder token images fill (set by the engine
        # builder); None: the model takes no images and a request with one is refused.
        self.image_token_id: int | None = None
        self.stats = EngineStats()
        self._requests: dict[str, _RequestState] = {}
        self._seqs: dict[int, Sequence] = {}
        self._expert_tokens: list[list[int]] = []  # the runner's last MoE load snapshot
        self._pending: list[TokenDelta] = []  # deltas produced between steps (aborts)
        self._prompt_lps: dict[int, list] = {}  # seq_id -> prompt logprobs so far
        self._thinking: dict[int, ThinkingSteer] = {}  # seq_id -> its thinking budget's state
        # The runner's knowledge, for the next StepDescription's deltas:
        self._views: dict[int, _RunnerView] = {}
        self._finished_ids: list[int] = []  # sequences the runner saw that have finished
        self._preempted_ids: list[int] = []
        self._step_id = 0
        # The last step's StepDescription (its shape is what a step trace records,
        # servelm/engine/step_trace.py); None before the first step.
        self.last_step_description: StepDescription | None = None
        self.kv_connector.bind(self)

    # -- admission -------------------------------------------------------------------------

    def add_request(self, request: EngineRequest, *, prompt_checked: bool = False) -> None:
        """Validate and queue. Raises InvalidParameterError for what can never be served.
        prompt_checked: the caller vouches that every prompt id is an int inside the
        vocabulary (the simulator, for the workloads it draws itself), and the per-token
        check is skipped; every other check runs."""
        if request.request_id in self._requests:
            raise InvalidParameterError(f"request_id {request.request_id!r} is already running",
                                        param="request_id")
        max_tokens = self._check_request(request, prompt_checked)
        if request.images:
            check_images(request, self.image_token_id)
        if self.scheduler.policy is not None:  # may refuse: the TTFT cannot be met (429)
            self.scheduler.policy.check_admission(self.scheduler, request)
        params = request.sampling_params
        lora = self._lora_entry(request.lora_name)
        timings = RequestTimings(arrival_time=request.arrival_time or self.clock())
        extra_key = params.cache_salt
        lora_id = None
        if lora is not None:  # two adapters never share KV: the adapter is in the namespace
            lora_id = lora.lora_id
            extra_key = f"lora:{lora.name}#{lora_id}" + ("" if extra_key is None
                                                         else f"|salt:{extra_key}")
            self.loras.add_live(lora_id, params.n)
        seqs = [Sequence(request.request_id, i, request.prompt_token_ids, params, timings,
                         max_tokens, extra_key, lora_id) for i in range(params.n)]
        detoks = {s.seq_id: self._detokenizer(request) for s in seqs}
        self._requests[request.request_id] = _RequestState(request, seqs, timings, detoks,
                                                           len(seqs))
        for seq in seqs:
            seq.slo = request.slo
            seq.images = request.images
            self._seqs[seq.seq_id] = seq
            if params.thinking_budget is not None:
                self._thinking[seq.seq_id] = ThinkingSteer(params.thinking_budget)
        # A disaggregated decode role holds the sequences back until their KV has arrived.
        if not self.kv_connector.on_add(request, seqs):
            self.admit(seqs)
        self.stats.num_prompt_tokens += len(request.prompt_token_ids) * params.n

    def admit(self, seqs: list[Sequence]) -> None:
        """Into the scheduler's waiting queue (a KV connector hands back what it held)."""
        for seq in seqs:
            self.scheduler.add(seq)

    @property
    def admission_reserve(self) -> int:
        return self.scheduler.admission_reserve

    def _lora_entry(self, name: str | None):
        if name is None:
            return None
        if self.loras is None:
            raise InvalidParameterError(f"the model `{name}` does not exist (this engine serves "
                                        "no LoRA adapters: start it with --lora or "
                                        "--enable-lora)", param="model", code="model_not_found")
        return self.loras.lookup(name)

    # -- LoRA adapters (plain data here; the runner is told through the step contract) ----

    def load_lora(self, name: str, path: str) -> None:
        """Register an adapter (checked against the base model now, servelm/lora/adapter.py);
        it is read into the runner's host memory with the next step."""
        if self.loras is None:
            raise InvalidParameterError("this engine was started without LoRA (use --lora or "
                                        "--enable-lora)", param="lora_name")
        self.loras.register(name, path)

    def unload_lora(self, name: str) -> bool:
        """Unregister an adapter: new requests for it are refused at once; sequences using it
        run to the end, then it is dropped. True: gone now."""
        if self.loras is None:
            raise InvalidParameterError("this engine was started without LoRA",
                                        param="lora_name")
        return self.loras.unregister(name)

    def lora_names(self) -> list[str]:
        return self.loras.names() if self.loras is not None else []

    def _check_request(self, request: EngineRequest, prompt_checked: bool = False) -> int:
        ids = request.prompt_token_ids
        if not ids:
            raise InvalidParameterError("prompt must not be empty", param="prompt")
        # Plain ints (every prompt from the front end) are checked by C loops: the types'
        # set, then min and max; only anything else, or an id out of range, takes the loop
        # that names the offender (a simulated fleet admits millions of long prompts).
        if not prompt_checked and (set(map(type, ids)) != {int} or min(ids) < 0
                                   or max(ids) >= self.vocab_size):
            for t in ids:
                if not (isinstance(t, int) and 0 <= t < self.vocab_size):
                    raise InvalidParameterError(
                        f"prompt token id {t!r} is outside the vocabulary "
                        f"[0, {self.vocab_size})", param="prompt")
        n_prompt = len(ids)
        params = request.sampling_params
        params.check_vocab(self.vocab_size)
        if n_prompt >= self.max_model_len:
            raise InvalidParameterError(
                f"prompt has {n_prompt} tokens; this model's context is {self.max_model_len} "
                f"tokens and at least one must be left to generate", param="prompt",
                code="context_length_exceeded")
        pool_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(self.max_model_len, pool_tokens) - n_prompt
        elif n_prompt + max_tokens > self.max_model_len:
            raise InvalidParameterError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the model "
                f"context of {self.max_model_len} tokens", param="max_tokens",
                code="context_length_exceeded")
        if n_prompt + max_tokens > pool_tokens:
            raise InvalidParameterError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the whole KV "
                f"cache ({pool_tokens} tokens); lower max_tokens or raise --kv-cache-memory",
                param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def _detokenizer(self, request: EngineRequest) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        p = request.sampling_params
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.stop,
                                      p.skip_special_tokens)

    def abort(self, request_id: str) -> bool:
        """Finish every sequence of a request now; its final deltas come with the next step."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        self.kv_connector.on_abort(request_id)  # a held request goes back to be finished
        for seq in state.seqs:
            if not seq.is_finished:
                self._pending.append(self._finish(seq, SequenceStatus.FINISHED_ABORTED, "",
                                                  [], None, self.clock()))
        return True

    # -- the step --------------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending) or self.kv_connector.has_work

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def _request_counts(self) -> tuple[int, int]:
        """(requests with a running sequence, requests waiting with none running)."""
        running = {s.request_id for s in self.scheduler.running}
        return len(running), len({s.request_id for s in self.scheduler.waiting} - running)

    @property
    def num_waiting_requests(self) -> int:
        return self._request_counts()[1]

    def step(self) -> list[TokenDelta]:
        deltas, self._pending = self._pending, []
        # transfer messages and timeouts, disk reads and writes finished since the last step
        self.kv_connector.poll()
        batch = self.scheduler.schedule()
        self._note_preempted(batch.preempted)
        if batch.is_empty:
            if self._idle_kv_step():
                return deltas
            if self.block_manager.num_pinned_blocks:
                return deltas  # blocks come back when the transfers holding them end
            if self.scheduler.waiting and not self.scheduler.running:
                # Admission guarantees every request fits an empty pool: this is a bug.
                raise RuntimeError(f"scheduler made no progress: {self.scheduler.waiting[0]}, "
                                   f"{self.block_manager.num_free_blocks} free blocks")
            return deltas
        start = self.clock()
        for s in batch.seqs:
            if s.seq.timings.first_scheduled_time is None:
                s.seq.timings.first_scheduled_time = start
        step = self.last_step_description = self.describe(batch)
        result: StepResult = self.runner.execute(step)
        now = self.clock()
        self.kv_connector.on_saved(result.kv_saved)  # e.g. saved blocks move down a tier
        self.kv_connector.on_step(step, now - start)  # e.g. the step feeds a cost estimate
        if result.expert_tokens:
            self._expert_tokens = result.expert_tokens  # the next report carries it
        if result.num_images_encoded or result.num_encoder_cache_hits:
            self.stats.num_images_encoded += result.num_images_encoded
            self.stats.num_encoder_cache_hits += result.num_encoder_cache_hits
            self.stats.encoder_time_s += result.encoder_s
        shape = self._account(batch, now - start, result.spec, result.draft_s)
        if self.scheduler.policy is not None:  # the step's time sizes background work
            self.scheduler.policy.observe_step(batch.seqs, now - start)
        if self.speculator is not None:  # the target's part of the step, and its tokens
            self.speculator.observe_step(now - start - result.draft_s, *shape)
        # A speculating sequence gets several tokens; once one finishes it, the rest go.
        self._keep_prompt_logprobs(result)
        for sampled in result.sampled:
            seq = self._seqs.get(sampled.seq_id)
            if seq is None or seq.is_finished:
                continue
            first = seq.num_output_tokens == 0
            kept = self._prompt_lps.pop(seq.seq_id, None) if first else None
            token, logprob = self._steered(seq.seq_id, sampled)
            delta = self._on_token(seq, token, logprob, now)
            if first:
                self._attach_prompt_outputs(seq, delta, result, kept)
            deltas.append(delta)
        if self.block_manager.sliding_window and not self.kv_connector.reads_prompt_blocks:
            for s in batch.seqs:  # blocks the window has passed go back to the pool
                if not s.seq.is_finished:
                    self.block_manager.drop_out_of_window(s.seq)
        return deltas

    def _steered(self, seq_id: int, sampled) -> tuple[int, Logprob | None]:
        """The token to append: the sampled one, or the end of a thinking block whose budget
        is spent (its logprob then says it was certain: the model did not choose it)."""
        steer = self._thinking.get(seq_id)
        if steer is None:
            return sampled.token_id, sampled.logprob
        token = steer.next_token(sampled.token_id)
        if steer.is_done:
            del self._thinking[seq_id]
        if token == sampled.token_id or sampled.logprob is None:
            return token, sampled.logprob
        return token, Logprob(token, 0.0, [(token, 0.0)][:len(sampled.logprob.top)])

    def _keep_prompt_logprobs(self, result: StepResult) -> None:
        """Prompt logprobs arrive per prefill chunk; a recompute after preemption sends
        positions again (kept until the first token delivers them, ignored after)."""
        for seq_id, chunk in result.prompt_logprobs.items():
            seq = self._seqs.get(seq_id)
            if seq is None or seq.num_output_tokens > 0:
                continue
            kept = self._prompt_lps.setdefault(seq_id, [None] * seq.num_prompt_tokens)
            kept[chunk.start + 1:chunk.start + 1 + len(chunk.logprobs)] = chunk.logprobs

    def _attach_prompt_outputs(self, seq: Sequence, delta: TokenDelta, result: StepResult,
                               kept: list | None) -> None:
        """The first token's delta carries the prompt's logprobs and pooled state."""
        if seq.params.prompt_logprobs is not None:
            delta.prompt_logprobs = kept or [None] * seq.num_prompt_tokens
        if seq.params.pooling is not None:
            delta.embedding = result.embeddings.get(seq.seq_id)

    def describe(self, batch: ScheduledBatch) -> StepDescription:
        """The batch as plain data: per sequence the tokens and blocks the runner has not
        seen yet (all of them, and the sampling parameters, on first sight), plus the
        sequences finished or preempted since the last step."""
        views = self._views
        seqs = []
        for s in batch.seqs:
            seq = s.seq
            view = views.get(seq.seq_id)
            new = None
            if view is None:
                view = views[seq.seq_id] = _RunnerView()
                new = NewSequence(seq.params, seq.num_prompt_tokens, seq.seed, seq.lora_id,
                                  seq.images)
            table = seq.block_table
            kept = min(view.num_blocks, len(table))
            seqs.append(ScheduledSequence(
                seq.seq_id, s.start, s.num_new_tokens, seq.token_ids[view.num_tokens:], kept,
                table[kept:], s.num_spec, new))
            view.num_tokens = len(seq.token_ids)
            view.num_blocks = len(table)
        self._step_id += 1
        step = StepDescription(self._step_id, seqs, self._finished_ids, self._preempted_ids,
                               self.loras.drain() if self.loras is not None else None)
        self._finished_ids, self._preempted_ids = [], []
        # evicted blocks read, reloaded ones written, first
        step.kv_saves = self.kv_connector.take_saves()
        step.kv_loads = self.kv_connector.take_loads()
        return step

    def _idle_kv_step(self) -> bool:
        """Nothing to compute: run the connector's pending block moves, or wait a moment for
        its reads (a request waiting on them is admitted once they finish)."""
        kv = self.kv_connector
        if kv.has_step_work:
            self._step_id += 1
            step = StepDescription(self._step_id, [], kv_saves=kv.take_saves(),
                                   kv_loads=kv.take_loads())
            kv.on_saved(self.runner.execute(step).kv_saved)
            return True
        if kv.is_busy:
            kv.wait(0.01)
            return True
        return False

    def execute_kv(self, saves: list[int], loads: list[KVBlock]) -> list[KVBlock]:
        """A step with no sequences: read `saves`, then write `loads` (the step contract's
        KV ops); returns the saved blocks' contents (a connector calls it through
        kv_worker)."""
        self._step_id += 1
        # Blocks the pool evicted to make room for `loads` are saved first (KV tiers).
        mine = self.kv_connector.take_saves()
        saved = self.runner.execute(StepDescription(self._step_id, [], kv_saves=mine + saves,
                                                    kv_loads=loads)).kv_saved
        if mine:
            self.kv_connector.on_saved(saved[:len(mine)])
        return saved[len(mine):]

    def _note_preempted(self, victims: list[Sequence]) -> None:
        for seq in victims:
            view = self._views.get(seq.seq_id)
            if view is not None:  # its blocks are gone; the runner keeps tokens and params
                view.num_blocks = 0
                self._preempted_ids.append(seq.seq_id)

    def _account(self, batch: ScheduledBatch, step_s: float, spec: dict,
                 draft_s: float) -> tuple[int, int, int]:
        """Advance each sequence's computed tokens; returns the tokens the model ran as
        (plain decode, verification, prefill) counts."""
        prefilling = set()
        ran = []  # (start, tokens run) per sequence
        decode = verify = prefill = max_chunk = 0
        for s in batch.seqs:
            seq = s.seq
            if s.start < seq.num_prompt_tokens and seq.request_id not in prefilling:
                prefilling.add(seq.request_id)
                seq.timings.prefill_time += step_s
            if s.num_spec:
                outcome = spec.get(seq.seq_id)
                proposed = outcome.num_proposed if outcome else 0
                accepted = outcome.num_accepted if outcome else 0
                # KV is valid for the fed token and the accepted drafts; the rest is rolled
                # back (their slots are overwritten later or their blocks given back).
                self.scheduler.rollback(seq, s.start + 1 + accepted)
                view = self._views[seq.seq_id]
                view.num_blocks = min(view.num_blocks, len(seq.block_table))
                ran.append((s.start, 1 + proposed))
                if proposed:
                    verify += 1 + proposed
                else:
                    decode += 1
                if outcome is not None:
                    self._account_spec(outcome)
            else:
                seq.num_computed_tokens += s.num_new_tokens
                ran.append((s.start, s.num_new_tokens))
                if s.num_new_tokens == 1 and s.start >= seq.num_prompt_tokens:
                    decode += 1
                else:
                    prefill += s.num_new_tokens
                    max_chunk = max(max_chunk, s.num_new_tokens)
        num_tokens = sum(n for _, n in ran)
        st = self.stats
        st.num_steps += 1
        st.last_step_s = step_s
        st.last_num_seqs = len(batch.seqs)
        st.last_num_tokens = num_tokens
        st.last_num_context_tokens = sum(start + n for start, n in ran)
        st.last_num_attention_pairs = sum(attention_pairs(start, n) for start, n in ran)
        st.last_num_decode_tokens, st.last_num_verify_tokens = decode, verify
        st.last_num_prefill_tokens = prefill
        st.last_max_prefill_chunk = max_chunk
        st.num_computed_tokens += num_tokens
        st.num_computed_prompt_tokens += sum(
            max(0, min(s.start + s.num_new_tokens, s.seq.num_prompt_tokens) - s.start)
            for s in batch.seqs if not s.num_spec)
        if spec or draft_s:
            st.spec_draft_s += draft_s
            st.spec_step_s += step_s
            if self.speculator is not None:
                self.speculator.observe_draft(sum(1 for s in batch.seqs if s.num_spec),
                                              draft_s, step_s, len(spec))
        return decode, verify, prefill

    def _account_spec(self, outcome) -> None:
        st = self.stats
        st.spec_num_verifications += 1
        st.spec_num_proposed += outcome.num_proposed
        st.spec_num_accepted += outcome.num_accepted
        st.count_acceptance(outcome.num_accepted, outcome.depth or outcome.num_proposed)
        if self.speculator is not None:
            self.speculator.observe_verify(outcome.num_proposed, outcome.num_accepted)

    def _on_token(self, seq: Sequence, token: int, logprob, now: float) -> TokenDelta:
        seq.append_token(token)
        self.stats.num_generated_tokens += 1
        timings = seq.timings
        if timings.first_token_time is None:
            timings.first_token_time = now
        timings.last_token_time = now
        params = seq.params
        detok = self._requests[seq.request_id].detokenizers[seq.seq_id]
        logprobs = [logprob] if logprob is not None else None
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            text = detok.flush() if detok else ""
            return self._finish(seq, SequenceStatus.FINISHED_STOPPED, text, [token], logprobs,
                                now)
        match = detok.add_token(token, seq.num_output_tokens >= params.min_tokens) if detok \
            else None
        text = match.text if match else ""
        if match and match.stopped:
            return self._finish(seq, SequenceStatus.FINISHED_STOPPED, text, [token], logprobs,
                                now)
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            text += detok.flush() if detok else ""
            return self._finish(seq, SequenceStatus.FINISHED_LENGTH, text, [token], logprobs,
                                now)
        return TokenDelta(seq.request_id, seq.index, text, [token], logprobs,
                          num_prompt_tokens=seq.num_prompt_tokens,
                          num_output_tokens=seq.num_output_tokens)

    def _finish(self, seq: Sequence, status: SequenceStatus, text: str, token_ids: list[int],
                logprobs, now: float) -> TokenDelta:
        self.kv_connector.on_finish(seq, status)  # a prefill role pins what it still sends
        self.scheduler.finish(seq, status)
        if seq.lora_id is not None:
            self.loras.finish_live(seq.lora_id)
        self._prompt_lps.pop(seq.seq_id, None)
        self._thinking.pop(seq.seq_id, None)
        if self._views.pop(seq.seq_id, None) is not None:
            self._finished_ids.append(seq.seq_id)
        del self._seqs[seq.seq_id]
        state = self._requests[seq.request_id]
        state.num_unfinished -= 1
        reason = status.finish_reason
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1
        timings = None
        if state.num_unfinished == 0:
            state.timings.finish_time = now
            timings = state.timings
            del self._requests[seq.request_id]
        return TokenDelta(seq.request_id, seq.index, text, token_ids, logprobs, reason,
                          num_prompt_tokens=seq.num_prompt_tokens,
                          num_output_tokens=seq.num_output_tokens, timings=timings)

    def enable_kv_events(self) -> None:
        """Record blocks entering and leaving the prefix cache (for a router's view); a
        server's engine loop drains them after every step."""
        if self.block_manager.prefix_cache is not None:
            self.block_manager.prefix_cache.enable_events()

    def drain_kv_events(self) -> list[KVEvent]:
        cache = self.block_manager.prefix_cache
        if cache is None or not cache.record_events:
            return []
        return [KVEvent(*e) for e in cache.drain_events()]

    def report(self, step_s: float | None = None) -> StepReport:
        """The last step's shape and the running counters, as plain data (metrics)."""
        st, sched, bm = self.stats, self.scheduler, self.block_manager
        cache = bm.prefix_cache.usage() if bm.prefix_cache is not None else None
        num_running, num_waiting = self._request_counts()
        return StepReport(
            step_s=step_s, last_num_seqs=st.last_num_seqs, last_num_tokens=st.last_num_tokens,
            last_num_context_tokens=st.last_num_context_tokens,
            last_num_attention_pairs=st.last_num_attention_pairs, num_steps=st.num_steps,
            last_max_prefill_chunk=st.last_max_prefill_chunk,
            num_preemptions=sched.num_preemptions, spec_num_proposed=st.spec_num_proposed,
            spec_num_accepted=st.spec_num_accepted,
            spec_mean_accepted_length=st.spec_mean_accepted_length,
            spec_draft_time_share=st.spec_draft_time_share,
            spec_k=self.speculator.last_k if self.speculator is not None else None,
            spec_accepted_lengths=list(st.spec_accepted_lengths),
            spec_position_acceptance=st.spec_position_acceptance,
            num_running_requests=num_running, num_waiting_requests=num_waiting,
            num_used_blocks=bm.num_used_blocks, num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            prefix_cache_namespaces=cache.num_namespaces if cache else 0,
            prefix_cache_bytes=cache.num_bytes if cache else 0, **self._lora_report(),
            moe_expert_tokens=self._take_expert_tokens(),
            num_images_encoded=st.num_images_encoded,
            num_encoder_cache_hits=st.num_encoder_cache_hits, encoder_time_s=st.encoder_time_s,
            **self.kv_connector.report())

    def _take_expert_tokens(self) -> list[list[int]]:
        tokens, self._expert_tokens = self._expert_tokens, []
        return tokens

    def _lora_report(self) -> dict:
        lo = self.loras
        if lo is None:
            return {}
        return dict(lora_num_adapters=len(lo.by_name), lora_num_resident=lo.num_resident,
                    lora_num_loads=lo.num_loads, lora_num_evictions=lo.num_evictions)

    def check_invariants(self) -> None:
        """free + held == total; no finished sequence holds a block."""
        live = self.scheduler.live_sequences()
        self.block_manager.check_invariants(live)
        assert all(not s.is_finished for s in live)
        if self.loras is not None:
            self.loras.check_invariants([s.lora_id for s in self.scheduler.running
                                         if s.lora_id is not None])
        self.kv_connector.check_invariants()


FINISH_REASONS = [r.value for r in FinishReason]
