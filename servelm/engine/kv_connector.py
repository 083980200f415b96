"""KVConnector: one interface for KV entering or leaving the device pool.

Owns: the interface an engine is given at construction (`Engine(..., kv_connector=...)`)
for every way KV moves between its pool and the world outside it, what a connector may ask
of the engine (KVConnectorHost, KVWorker), the connector that is off (NoKVConnector: every
hook a no-op, so no hot path checks for None) and MultiKVConnector (several at once).
Never: an implementation of a transfer or a store (servelm/disagg/roles.py PrefillRole and
DecodeRole, servelm/kv_tiers/tiers.py KVTiers hold them), tensors, or being set on an engine
after it was built.

Scheduler side (engine thread, between and inside steps):

    request life   on_add(request, seqs) -> held?   on_abort(request_id)
                   on_finish(seq, status): the engine frees seq's blocks right after this;
                   a connector still reading them pins them here (BlockManager.pin) and
                   unpins when done: that is when the blocks may be freed
    admission      plan_load(seq, device match) -> ExternalLoad | None: the blocks after the
                   match it can load (num_blocks), or is_pending: wait, skipped, this step
                   on_admitted(seq, num_matched_blocks, plan): blocks were allocated; queue
                   the loads into them and move seq's computed tokens past them
    each step      poll() before scheduling; take_saves() / take_loads(): the block ids the
                   step reads out and the blocks it writes, before the forward; on_saved(kv)
                   the bytes read, in take_saves order; on_step(step, step_s) a timed step

Worker side (the runner, through the step contract, servelm/core/contract.py): a step's
kv_saves are read before anything overwrites them, its kv_loads written before the forward.
Outside a step a connector moves blocks through KVWorker: start_loads, save_blocks, then
wait, which runs them as one KV-only step (after the blocks the other connectors queued).

    Engine(kv_connector=MultiKVConnector([DecodeRole(...), KVTiers(...)]))
       │ bind(host)          the engine hands each part itself as KVConnectorHost
       ├─ DecodeRole         on_add holds a request; poll loads arriving frames (KVWorker)
       └─ KVTiers            plan_load / on_admitted reload; take_saves moves evictions down
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from servelm.core.contract import KVBlock, StepDescription

if TYPE_CHECKING:
    from servelm.engine.block_manager import BlockManager
    from servelm.engine.sequence import Sequence, SequenceStatus
    from servelm.protocol import EngineRequest


class ExternalLoad(Protocol):
    """A connector's answer to plan_load (KVTiers' LoadPlan is one)."""

    @property
    def num_blocks(self) -> int: ...  # blocks after the device match it loads

    @property
    def is_pending(self) -> bool: ...  # still being fetched: the request waits this step


class KVWorker(Protocol):
    """The worker side a connector drives outside a step: start, then wait for, the moves."""

    def start_loads(self, loads: list[KVBlock]) -> None: ...

    def save_blocks(self, block_ids: list[int]) -> None: ...

    def wait(self) -> list[KVBlock]:
        """Run what was started; returns the saved blocks' bytes in save_blocks order."""
        ...


class KVConnectorHost(Protocol):
    """What an engine offers the connector it was built with (bind)."""

    block_manager: BlockManager
    clock: Callable[[], float]
    kv_worker: KVWorker

    @property
    def admission_reserve(self) -> int: ...  # blocks admission keeps free

    def admit(self, seqs: list[Sequence]) -> None:
        """Hand sequences a connector held (on_add returned True) to the scheduler."""
        ...


class KVConnector:
    """The interface, with every hook a no-op: a connector overrides what it uses."""

    name = "none"
    # The connector reads a sequence's prompt blocks after they were computed, so a
    # sliding window must not give them back early.
    reads_prompt_blocks = False

    def bind(self, host: KVConnectorHost) -> None:
        """The engine, once, while it is built."""

    # -- request lifecycle -----------------------------------------------------------------

    def on_add(self, request: EngineRequest, seqs: list[Sequence]) -> bool:
        """True: the connector holds the sequences and admits them later (host.admit)."""
        return False

    def on_abort(self, request_id: str) -> None:
        """Before the engine finishes an aborted request's sequences."""

    def on_finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Before the engine frees seq's blocks: pin those still to be read."""

    # -- admission -------------------------------------------------------------------------

    def plan_load(self, seq: Sequence, match) -> ExternalLoad | None:
        return None

    def on_admitted(self, seq: Sequence, num_matched_blocks: int, plan) -> None:
        """seq holds blocks for plan's tokens now (only called with this connector's plan)."""

    # -- each step -------------------------------------------------------------------------

    def poll(self) -> None:
        """Engine thread, before scheduling: take what finished since the last step."""

    def take_saves(self) -> list[int]:
        return []

    def take_loads(self) -> list[KVBlock]:
        return []

    def on_saved(self, saved: list[KVBlock]) -> None:
        """The bytes of the blocks take_saves asked for, in that order."""

    def on_step(self, step: StepDescription, step_s: float) -> None:
        """A step with sequences ran in step_s seconds."""

    @property
    def has_step_work(self) -> bool:
        """Saves or loads queued: worth a KV-only step when nothing else runs."""
        return False

    @property
    def is_busy(self) -> bool:
        """Fetches in flight that a waiting request waits for."""
        return False

    def wait(self, timeout: float) -> None:
        """Wait up to timeout seconds for a fetch (an idle engine)."""

    @property
    def has_work(self) -> bool:
        """Work with peers in flight: the engine is not done while it lasts."""
        return False

    # -- the engine loop and reporting ------------------------------------------------------

    def set_wake(self, wake: Callable[[], None]) -> None:
        """wake() from any thread: something arrived, step soon."""

    def take_changed(self) -> bool:
        """Whether something worth a report happened outside a step since the last call."""
        return False

    def report(self) -> dict[str, dict]:
        """StepReport fields (kv_tiers, kv_transfer) -> this connector's counters."""
        return {}

    def check_invariants(self) -> None:
        pass

    def close(self) -> None:
        """The engine is stopping: end work with peers now, finish queued writes."""

    @property
    def parts(self) -> list[KVConnector]:
        return [self]


class NoKVConnector(KVConnector):
    """No KV enters or leaves the pool (a colocated engine without tiers)."""


class MultiKVConnector(KVConnector):
    """Several connectors on one engine, each called in order (a decode worker that also
    offloads to host memory: [DecodeRole, KVTiers]). A request's load plan is the first
    part's that answers; saves and loads are concatenated and their bytes handed back by
    part."""

    name = "multi"

    def __init__(self, connectors: list[KVConnector]):
        if not connectors:
            raise ValueError("connectors: MultiKVConnector needs at least one")
        self.connectors = [p for c in connectors for p in c.parts]
        self.reads_prompt_blocks = any(c.reads_prompt_blocks for c in self.connectors)
        self._planned: dict[int, KVConnector] = {}  # seq_id -> the part whose plan it took
        self._num_saves: list[int] = []  # per part, the last take_saves

    @property
    def parts(self) -> list[KVConnector]:
        return list(self.connectors)

    def bind(self, host: KVConnectorHost) -> None:
        for c in self.connectors:
            c.bind(host)

    def on_add(self, request, seqs) -> bool:
        return any([c.on_add(request, seqs) for c in self.connectors])  # each part sees it

    def on_abort(self, request_id: str) -> None:
        for c in self.connectors:
            c.on_abort(request_id)

    def on_finish(self, seq, status) -> None:
        self._planned.pop(seq.seq_id, None)
        for c in self.connectors:
            c.on_finish(seq, status)

    def plan_load(self, seq, match):
        for c in self.connectors:
            plan = c.plan_load(seq, match)
            if plan is not None:
                self._planned[seq.seq_id] = c
                return plan
        return None

    def on_admitted(self, seq, num_matched_blocks: int, plan) -> None:
        self._planned.pop(seq.seq_id).on_admitted(seq, num_matched_blocks, plan)

    def poll(self) -> None:
        for c in self.connectors:
            c.poll()

    def take_saves(self) -> list[int]:
        saves = [c.take_saves() for c in self.connectors]
        self._num_saves = [len(s) for s in saves]
        return [b for s in saves for b in s]

    def take_loads(self) -> list[KVBlock]:
        return [b for c in self.connectors for b in c.take_loads()]

    def on_saved(self, saved: list[KVBlock]) -> None:
        counts, self._num_saves = self._num_saves, []
        if sum(counts) != len(saved):
            raise RuntimeError(f"runner returned {len(saved)} saved blocks, the connectors "
                               f"asked for {sum(counts)}")
        start = 0
        for c, n in zip(self.connectors, counts):
            if n:
                c.on_saved(saved[start:start + n])
            start += n

    def on_step(self, step: StepDescription, step_s: float) -> None:
        for c in self.connectors:
            c.on_step(step, step_s)

    @property
    def has_step_work(self) -> bool:
        return any(c.has_step_work for c in self.connectors)

    @property
    def is_busy(self) -> bool:
        return any(c.is_busy for c in self.connectors)

    def wait(self, timeout: float) -> None:
        busy = [c for c in self.connectors if c.is_busy]
        if busy:
            busy[0].wait(timeout)

    @property
    def has_work(self) -> bool:
        return any(c.has_work for c in self.connectors)

    def set_wake(self, wake) -> None:
        for c in self.connectors:
            c.set_wake(wake)

    def take_changed(self) -> bool:
        return any([c.take_changed() for c in self.connectors])  # every part's flag resets

    def report(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for c in self.connectors:
            for field, counters in c.report().items():
                if field in out:
                    raise RuntimeError(f"two KV connectors report {field}")
                out[field] = counters
        return out

    def check_invariants(self) -> None:
        for c in self.connectors:
            c.check_invariants()

    def close(self) -> None:
        for c in self.connectors:
            c.close()


def combine(connectors: list[KVConnector]) -> KVConnector:
    """The engine's one connector: none, the only one, or a MultiKVConnector."""
    if not connectors:
        return NoKVConnector()
    return connectors[0] if len(connectors) == 1 else MultiKVConnector(connectors)


def find_connector(connector: KVConnector, kind: type):
    """The part of `connector` that is a `kind` (tests, reports), or None."""
    return next((c for c in connector.parts if isinstance(c, kind)), None)


class StepKVWorker:
    """KVWorker over an engine's KV-only steps: execute(saves, loads) -> saved bytes."""

    def __init__(self, execute: Callable[[list[int], list[KVBlock]], list[KVBlock]]):
        self._execute = execute
        self._saves: list[int] = []
        self._loads: list[KVBlock] = []

    def start_loads(self, loads: list[KVBlock]) -> None:
        self._loads.extend(loads)

    def save_blocks(self, block_ids: list[int]) -> None:
        self._saves.extend(block_ids)

    def wait(self) -> list[KVBlock]:
        saves, loads, self._saves, self._loads = self._saves, self._loads, [], []
        if not saves and not loads:
            return []
        return self._execute(saves, loads)


__all__ = ["ExternalLoad", "KVConnector", "KVConnectorHost", "KVWorker", "MultiKVConnector",
           "NoKVConnector", "StepKVWorker", "combine", "find_connector"]
