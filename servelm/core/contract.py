"""The step contract between the scheduler and a runner: plain data in, plain data out.

Owns: `StepDescription` (what one step computes, as deltas against what the runner already
knows), `StepResult` (what it produced), `StepReport` (a step's shape and counters, for
metrics on the other side of a process boundary) and the `Runner` protocol that
`ModelRunner`, the test fake and the simulator's runner implement.
Never: imports torch, or holds a pointer into engine state. Every type here is a msgspec
Struct that `servelm.core.codec` carries across processes.

What a runner knows about a sequence is built only from these deltas:

    step 1   seq 7 first seen:  new=NewSequence(params, seed, num_prompt_tokens=5)
             new_token_ids=[p0 p1 p2 p3 p4]  num_kept_blocks=0  new_block_ids=[12 3]
    step 2   decode:            new_token_ids=[o0]                num_kept_blocks=2  new_block_ids=[]
    step 3   (rollback of drafts gave a block back, then one was taken again)
                                new_token_ids=[o1 o2]             num_kept_blocks=2  new_block_ids=[9]
    step 9   preempted_seq_ids=[7]: the runner drops the block table (tokens and params stay)
    step 12  resumed:           new_token_ids=[]  num_kept_blocks=0  new_block_ids=[4 5 6]
    step 20  finished_seq_ids=[7]: the runner forgets the sequence

so a step costs O(new tokens + new blocks), never O(context), on the wire.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from servelm.protocol import ImageInput, Logprob, SamplingParams

# 2: NewSequence.lora_id, StepDescription.lora, the LoRA counters of StepReport, the
# LoadLora / UnloadLora / LoraResult messages (servelm/core/codec.py).
# 3: KVBlock, StepDescription.kv_saves / kv_loads, StepResult.kv_saved; NewSequence.images,
# the encoder fields of StepResult and StepReport (vision-language models).
CONTRACT_VERSION = 3


class NewSequence(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sent once, the first time a runner sees a sequence."""

    params: SamplingParams
    num_prompt_tokens: int
    seed: int | None = None  # the sequence's own sampling stream (n > 1: distinct seeds)
    lora_id: int | None = None  # the adapter it runs with (LoraAdapterRef.lora_id); None: base
    images: list[ImageInput] = []  # the prompt's images (servelm/vision/runner.py encodes them)


class LoraAdapterRef(msgspec.Struct, array_like=True):
    """An adapter the engine registered: the runner reads it into host memory."""

    lora_id: int
    name: str
    path: str


class LoraDeltas(msgspec.Struct, array_like=True, omit_defaults=True):
    """Adapter changes since the last step, applied before the step's sequences: added ones
    read into host memory, removed ones forgotten (and their slot freed), then each slot in
    `slots` overwritten with that adapter's weights (servelm/lora/slots.py decides which)."""

    added: list[LoraAdapterRef] = []
    removed: list[int] = []
    slots: dict[int, int] = {}  # slot -> lora_id now in it


class ScheduledSequence(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence in one step. Positions start .. start + num_new_tokens - 1 get KV; the
    last num_spec of them are draft slots a proposer may fill."""

    seq_id: int
    start: int  # first position computed (tokens below it have KV already)
    num_new_tokens: int  # KV slots this step, draft slots included
    new_token_ids: list[int]  # tokens appended to the sequence since the runner last saw it
    num_kept_blocks: int  # the runner's block table is cut to this length ...
    new_block_ids: list[int]  # ... then these are appended
    num_spec: int = 0
    new: NewSequence | None = None


class KVBlock(msgspec.Struct, array_like=True):
    """One KV block's contents, leaving or entering a runner's pool (KV tiers below the
    pool, a disaggregated peer): every layer's K then V slots of the block, in the pool's
    storage dtype (servelm/attention/kv_cache.py read_block has the layout)."""

    block_id: int
    data: bytes


class StepDescription(msgspec.Struct, omit_defaults=True):
    """One step. A runner does its parts in this order:

        1. kv_saves   read these blocks (their bytes come back in StepResult.kv_saved)
        2. kv_loads   overwrite these blocks with the bytes given
        3. seqs       compute the scheduled sequences (may be empty: a KV-only step)

    so a block the engine evicts and hands to another sequence in the same step is saved
    before anything overwrites it."""

    step_id: int
    seqs: list[ScheduledSequence]
    finished_seq_ids: list[int] = []  # the runner forgets these (sent once, with any step)
    preempted_seq_ids: list[int] = []  # the runner drops their blocks (and draft KV)
    lora: LoraDeltas | None = None  # adapter registrations and slot loads (LoRA on)
    kv_saves: list[int] = []  # block ids to read, before anything else
    kv_loads: list[KVBlock] = []  # blocks to overwrite, before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class SampledToken(msgspec.Struct, array_like=True, omit_defaults=True):
    seq_id: int
    token_id: int
    logprob: Logprob | None = None


class SpecOutcome(msgspec.Struct, array_like=True):
    num_proposed: int  # drafts scored this step
    num_accepted: int  # of which the target accepted (one more token is always emitted)
    depth: int = 0  # draft positions that could be accepted (a tree's depth); 0: num_proposed


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Of one prefill chunk: logprobs[j] is the logprob of prompt token start + j + 1."""

    start: int
    logprobs: list[Logprob]


EXPERT_TOKENS_EVERY = 16  # steps between a runner's MoE expert-load snapshots


class StepResult(msgspec.Struct, omit_defaults=True):
    """sampled: the step's new tokens in order; a speculating sequence has several, the
    first num_accepted of its drafts and the target's next token."""

    sampled: list[SampledToken]
    spec: dict[int, SpecOutcome] = {}  # seq_id -> outcome, for sequences that had drafts
    prompt_logprobs: dict[int, PromptLogprobs] = {}  # seq_id -> this chunk's (when asked)
    embeddings: dict[int, list[float]] = {}  # seq_id -> pooled prompt hidden state
    forward_s: float = 0.0  # wall time of propose + model + sampling
    draft_s: float = 0.0  # of which the proposer took
    # MoE models, every EXPERT_TOKENS_EVERY steps: tokens routed to each expert of each MoE
    # layer since start-up ([layer][expert], cumulative); [] on the other steps
    expert_tokens: list[list[int]] = []
    kv_saved: list[KVBlock] = []  # the contents of StepDescription.kv_saves, in that order
    # vision encoder this step: images encoded, images found in the encoder cache, seconds
    num_images_encoded: int = 0
    num_encoder_cache_hits: int = 0
    encoder_s: float = 0.0


class StepReport(msgspec.Struct, omit_defaults=True):
    """A step's shape and the engine's running counters, for whoever keeps metrics (the
    server's front end, in another process). step_s None: no model step ran (only abort
    deltas came out)."""

    step_s: float | None = None
    last_num_seqs: int = 0
    last_num_tokens: int = 0
    last_num_context_tokens: int = 0
    last_num_attention_pairs: int = 0
    last_max_prefill_chunk: int = 0  # largest prompt/recompute chunk of one sequence
    num_steps: int = 0
    num_preemptions: int = 0
    spec_num_proposed: int = 0
    spec_num_accepted: int = 0
    spec_mean_accepted_length: float = 0.0
    spec_draft_time_share: float = 0.0
    spec_k: int | None = None  # None: speculation is off
    spec_accepted_lengths: list[int] = []  # [n]: verifications that accepted n drafts
    spec_position_acceptance: list[float] = []  # [i]: draft position i + 1's, when tried
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_used_blocks: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_namespaces: int = 0  # cache_salt namespaces holding a block
    prefix_cache_bytes: int = 0  # estimated bytes of the prefix cache's bookkeeping
    lora_num_adapters: int = 0  # registered LoRA adapters
    lora_num_resident: int = 0  # of which in a slot
    lora_num_loads: int = 0  # adapters copied into a slot so far
    lora_num_evictions: int = 0  # of which displaced another
    # the runner's latest expert_tokens (StepResult), on the first report after it came
    moe_expert_tokens: list[list[int]] = []
    # KV tiers below the pool (servelm/kv_tiers/): per tier ("host", "disk") its counters
    # (TierStats) and bandwidth, and "decisions" (reload / recompute counts); {} when off
    kv_tiers: dict[str, dict[str, float]] = {}
    # prefill/decode disaggregation (servelm/disagg/transfer.py TransferStats.as_dict); {}: off
    kv_transfer: dict[str, float] = {}
    # vision encoder since start-up (StepResult's, summed)
    num_images_encoded: int = 0
    num_encoder_cache_hits: int = 0
    encoder_time_s: float = 0.0


class KVEvent(msgspec.Struct, array_like=True):
    """A block entered (kind 0) or left (kind 1) the prefix cache, by chain hash
    (servelm/engine/prefix_cache.py block_hashes): what a router learns a replica caches."""

    kind: int
    hash: int
    parent: int


class Runner(Protocol):
    """Computes steps. Keeps its own per-sequence state (block tables, sampling streams,
    draft state), built from the deltas of each StepDescription; never reads engine state."""

    def execute(self, step: StepDescription) -> StepResult: ...


__all__ = ["CONTRACT_VERSION", "KVBlock", "KVEvent", "LoraAdapterRef", "LoraDeltas", "NewSequence", "PromptLogprobs", "Runner", "SampledToken", "ScheduledSequence",
           "SpecOutcome", "StepDescription", "StepReport", "StepResult"]
