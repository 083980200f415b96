"""The transfer state machine: one record per transfer on each side, its states, timeouts
and counters.

Owns: `SendState` / `RecvState` and the per-transfer records the roles keep
(servelm/disagg/roles.py drives them), `TransferTimeouts` (every state's bound), and
`TransferStats` (the counters a worker exports). Never: touches a socket or the engine.

    decode (receiver)                               prefill (sender)
    -----------------                               ----------------
    PULLING   blocks reserved + pinned, Pull sent   AWAITING_PULL     request computing, full
              frames verified and loaded                              blocks pinned as they fill
              as they come                          AWAITING_REQUEST  a Pull came first
    ...Sent(end) / lease end / Cancel / peer lost   SENDING           Pull matched: each pinned
    COMMITTED the loaded prefix cached, the rest                      block read and sent
              released, Ack(end) sent, the request  AWAITING_ACK      all sent (Sent(end))
              admitted (it computes the rest)       DONE              Ack: blocks unpinned
                                                    CANCELLED         Cancel / peer lost
                                                    EXPIRED           a deadline passed:
                                                                      blocks unpinned

Deadlines: decode's lease runs from its reservation; prefill's starts when the Pull arrives
(later) and adds `ack_grace_s`, so whatever the clocks, the decode side gives up before the
prefill side frees. Decode never reads the prefill worker's memory after an Ack (it holds its
own verified copy), so a late Ack meeting an expired lease changes nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransferTimeouts:
    lease_s: float = 30.0  # decode: how long reserved blocks wait for their frames
    pull_timeout_s: float = 30.0  # prefill: how long computed blocks wait for a Pull
    ack_grace_s: float = 2.0  # prefill: past the lease, how long it waits for the Ack

    def __post_init__(self) -> None:
        for name in ("lease_s", "pull_timeout_s", "ack_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kv {name} must be positive, got {getattr(self, name)}")


class SendState(enum.Enum):
    AWAITING_PULL = "awaiting_pull"
    AWAITING_REQUEST = "awaiting_request"
    SENDING = "sending"
    AWAITING_ACK = "awaiting_ack"
    DONE = "done"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class RecvState(enum.Enum):
    PULLING = "pulling"
    COMMITTED = "committed"


# The labels of fallbacks_total: why a decode worker computed (part of) a prompt itself, and
# how a prefill worker's transfer ended without an Ack (cancelled, expired).
FALLBACK_CAUSES = ("no_blocks", "prompt_states", "lora", "images", "connect", "peer_lost",
                   "lease_expired", "checksum", "frame_lost", "prefill_cancelled", "aborted",
                   "layout_mismatch", "cancelled", "expired")


@dataclass
class SendTransfer:
    transfer_id: str
    state: SendState
    deadline: float
    seq: object = None  # the engine's Sequence while it computes
    own_hashes: list[int] = field(default_factory=list)  # chain hashes of its full blocks
    channel: object = None
    first_block: int = 0  # from the Pull: decode holds the blocks below
    hashes: list[int] = field(default_factory=list)  # of blocks first_block .. end - 1
    pinned: dict[int, int] = field(default_factory=dict)  # prompt block index -> block id
    num_sent: int = 0  # blocks first_block .. first_block + num_sent - 1 are sent
    is_computed: bool = False  # the request finished: no more blocks will fill
    started: float = 0.0
    num_bytes: int = 0

    @property
    def end(self) -> int:
        return self.first_block + len(self.hashes)


@dataclass
class RecvTransfer:
    transfer_id: str
    request_id: str
    seqs: list
    tokens: list[int]
    extra_key: object
    channel: object
    first_block: int  # blocks below are this worker's own (prefix cache), pinned
    hashes: list[int]  # expected chain hashes of blocks first_block ..
    matched: list[int]  # block ids of the blocks below first_block
    reserved: list[int]  # block ids for first_block .., filled by loads
    deadline: float
    started: float
    state: RecvState = RecvState.PULLING
    loaded: set[int] = field(default_factory=set)  # indices written into `reserved`
    pending: dict[int, bytes] = field(default_factory=dict)  # verified, not yet loaded
    sent_end: int | None = None  # Sent(end) came
    bad: str | None = None  # a frame failed its checks: the cause
    pins: list[int] = field(default_factory=list)  # held until the request is admitted

    @property
    def end(self) -> int:
        return self.first_block + len(self.hashes)

    def num_contiguous(self) -> int:
        """Loaded blocks from first_block on, up to the first gap."""
        k = 0
        while self.first_block + k in self.loaded:
            k += 1
        return k


@dataclass
class TransferStats:
    """Counters of one worker's transfers (exported on /metrics as servelm_kv_*)."""

    num_started: int = 0
    num_completed: int = 0  # every block asked for arrived and was kept
    num_in_flight: int = 0
    num_bytes: int = 0  # block bytes sent (prefill) or kept (decode)
    num_blocks: int = 0
    num_blocks_deduped: int = 0  # decode: prompt blocks it held already (never sent)
    transfer_s: float = 0.0  # summed over finished transfers
    num_finished: int = 0
    last_bytes: int = 0
    last_s: float = 0.0
    num_lease_expiries: int = 0
    num_duplicate_frames: int = 0
    num_late_messages: int = 0  # for a transfer that had ended (ignored)
    fallbacks: dict[str, int] = field(default_factory=dict)  # cause -> count

    def finish(self, num_bytes: int, seconds: float) -> None:
        self.num_in_flight -= 1
        self.num_finished += 1
        self.num_bytes += num_bytes
        self.transfer_s += seconds
        self.last_bytes, self.last_s = num_bytes, seconds

    def fallback(self, cause: str) -> None:
        self.fallbacks[cause] = self.fallbacks.get(cause, 0) + 1

    def as_dict(self) -> dict[str, float]:
        out = {k: float(v) for k, v in vars(self).items() if k != "fallbacks"}
        out.update({f"fallback:{k}": float(v) for k, v in self.fallbacks.items()})
        return out


__all__ = ["FALLBACK_CAUSES", "RecvState", "RecvTransfer", "SendState", "SendTransfer",
           "TransferStats", "TransferTimeouts"]
