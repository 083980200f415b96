"""KVTiers: the KV tiers below the device pool as the engine's KVConnector (torch-free).

Owns: moving a block down when the device pool's prefix cache evicts it (its id into the
step's kv_saves, the bytes the runner returns into the first tier, what that tier pushes
out into the next), finding a waiting request's prefix below the pool, the reload-or-
recompute decision (reload_policy.py), checked reloads (entry.verify) read off the step on
the IO thread, the blocks a reload writes (the step's kv_loads), the per-request
CacheExplain and the per-tier counters, and the retention of blocks the prefix cache evicted
while retained (`prompt_cache_retention`): kept in the tiers until it ends, ahead of other
blocks, within the same per-tenant cap as in the pool (a RetentionBook by chain hash).
Never: tensors, a file path (disk_tier.py), or blocking a step: a request whose blocks are
still being read waits, skipped, while the others run.

    device pool ──evict──▶ host memory ──evict──▶ disk ──evict──▶ (dropped)
         ▲                     │                   │
         └──── kv_loads ◀──────┴── verify ◀────────┘  (IO thread for disk)

One implementation of servelm/engine/kv_connector.py's KVConnector, given to the engine at
construction (alone, or beside a disaggregation role in a MultiKVConnector). A request's
life through admission (Scheduler._admit_waiting calls plan_load, then on_admitted once the
blocks are allocated):

    device match [b0 b1] | host [h2 h3] | disk [d4]  | not found [..]
    plan_load: decision by cost; disk blocks missing from memory -> read queued, PENDING
    (later step) plan_load: every block read and verified -> LoadPlan(entries h2 h3 d4)
    allocate(seq, loaded + new tokens, match): fresh blocks for h2 h3 d4 + the new chunk;
    on_admitted: their ids and bytes into this step's kv_loads; num_computed_tokens past
    them. The same step computes the rest of the prompt on top (loads precede the forward).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter
from typing import NamedTuple

from servelm.core.contract import KVBlock, StepDescription
from servelm.engine.kv_connector import KVConnector, KVConnectorHost
from servelm.engine.prefix_cache import block_hash, namespace_hash
from servelm.engine.retention_book import Retention, RetentionBook
from servelm.engine.sequence import SequenceStatus
from servelm.kv_tiers.connector import TierStore
from servelm.kv_tiers.entry import BlockEntry, make_entry, verify
from servelm.kv_tiers.io_queue import IOQueue
from servelm.kv_tiers.reload_policy import (
    RELOAD_POLICIES,
    CacheExplain,
    PrefillEstimate,
    decide,
)


class LoadPlan(NamedTuple):
    entries: list[tuple[str, BlockEntry]]  # (tier name, verified entry), in prefix order
    is_pending: bool  # blocks are being read: the request waits this step
    explain: CacheExplain

    @property
    def num_blocks(self) -> int:
        return len(self.entries)


class _Save(NamedTuple):
    block: int
    hash: int
    parent: int
    token_ids: tuple[int, ...]
    retention: Retention | None = None


class KVTiers(KVConnector):
    name = "kv_tiers"

    def __init__(self, tiers: list[TierStore], block_size: int, block_nbytes: int,
                 reload_policy: str = "cost", estimate: PrefillEstimate | None = None,
                 io: IOQueue | None = None):
        if not tiers:
            raise ValueError("KVTiers needs at least one tier (host memory or disk)")
        if reload_policy not in RELOAD_POLICIES:
            raise ValueError(f"kv_reload_policy must be one of {RELOAD_POLICIES}, got "
                             f"{reload_policy!r}")
        self.tiers = tiers
        self.by_name = {t.name: t for t in tiers}
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.policy = reload_policy
        self.estimate = estimate or PrefillEstimate()
        self.io = io or IOQueue()
        self._queued: dict[int, _Save] = {}  # block -> save, for the next step
        self._in_flight: list[_Save] = []  # saves of the step being executed
        self._loads: list[KVBlock] = []
        self._fetches: dict[int, concurrent.futures.Future] = {}  # seq_id -> disk reads
        self._ready: dict[int, dict[int, tuple[str, BlockEntry]]] = {}  # seq_id -> verified
        self._hashes: dict[int, list[int]] = {}  # seq_id -> chain hashes of its full blocks
        self.num_reload = 0  # admissions that reloaded (decision counters)
        self.num_recompute = 0
        self.num_dropped_saves = 0  # evictions whose content was not saved (see _on_evict)
        # chain hash -> tenant and end of a retention that moved down (the cap: bind's)
        self._retention = RetentionBook(0)
        self._now = time.monotonic

    # -- wiring ------------------------------------------------------------------------------

    def bind(self, host: KVConnectorHost) -> None:
        cache = host.block_manager.prefix_cache
        if cache is None:
            raise ValueError("KV tiers need the prefix cache (drop --no-prefix-cache): "
                             "blocks are found again by their chain hash")
        cache.enable_hashes()
        cache.on_evict = self._on_evict
        self._retention = RetentionBook(cache.max_retained_blocks)
        self._now = cache.clock  # the clock the pool's retention ends are in

    def close(self) -> None:
        """Finish the queued reads and writes (a later run finds every block it saved)."""
        self.io.drain()
        self.poll()

    # -- moving down -------------------------------------------------------------------------

    def _on_evict(self, block: int, block_hash_: int, parent_hash: int,
                  token_ids: tuple[int, ...], retention: Retention | None = None) -> None:
        """The prefix cache dropped a cached-only block: save it in this step, unless a
        tier has it already (then it only counts as used). Its retention goes with it."""
        for tier in self.tiers:
            if tier.contains(block_hash_):
                _touch(tier, block_hash_)
                if retention is not None:
                    self._keep(block_hash_, retention)
                return
        if block in self._queued:
            # Evicted, reused and evicted again before any step ran: what the pool holds
            # now is the first content, the second one was never computed.
            self.num_dropped_saves += 1
            return
        self._queued[block] = _Save(block, block_hash_, parent_hash, token_ids, retention)

    def take_saves(self) -> list[int]:
        """Block ids for this step's kv_saves (read before anything overwrites them)."""
        self._in_flight = list(self._queued.values())
        self._queued = {}
        return [s.block for s in self._in_flight]

    def take_loads(self) -> list[KVBlock]:
        loads, self._loads = self._loads, []
        return loads

    @property
    def has_step_work(self) -> bool:
        return bool(self._queued or self._loads)

    def on_saved(self, saved: list[KVBlock]) -> None:
        """The runner's kv_saved, in kv_saves order: each block into the first tier."""
        saves, self._in_flight = self._in_flight, []
        if [b.block_id for b in saved] != [s.block for s in saves]:
            raise RuntimeError(f"runner returned kv_saved for blocks "
                               f"{[b.block_id for b in saved]}, asked for "
                               f"{[s.block for s in saves]}")
        for kv, s in zip(saved, saves):
            self.store(make_entry(s.hash, s.parent, s.token_ids, kv.data), s.retention)

    def store(self, entry: BlockEntry, retention: Retention | None = None) -> None:
        """Into the first tier; what a tier pushes out goes into the next one, still kept
        if it was; what the last one pushes out is gone."""
        pending = [entry]
        for tier in self.tiers:
            pushed = []
            for e in pending:
                pushed.extend(tier.put(e))
                if e.hash in self._retention:
                    tier.keep(e.hash)
            pending = pushed
            if not pending:
                break
        for e in pending:
            self._retention.release(e.hash)
        if retention is not None:
            self._keep(entry.hash, retention)

    def _keep(self, h: int, retention: Retention) -> None:
        """h's retention, within its tenant's cap (past it, the tenant's least recently
        retained blocks go back to their tier's plain LRU order)."""
        now = self._now()
        self._unkeep(self._retention.expire(now))
        if retention.until <= now:
            return
        kept, unpinned = self._retention.retain(retention.tenant, [h], retention.until, now)
        self._unkeep(unpinned)
        if kept:
            for tier in self.tiers:
                tier.keep(h)

    def _unkeep(self, hashes: list[int]) -> None:
        for h in hashes:
            for tier in self.tiers:
                tier.unkeep(h)

    # -- finding a prefix below the pool ------------------------------------------------------

    def _chain(self, seq, num_blocks: int) -> list[int]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        h = hashes[-1] if hashes else namespace_hash(seq.extra_key)
        for i in range(len(hashes), num_blocks):
            h = block_hash(h, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            hashes.append(h)
        return hashes

    def plan_load(self, seq, match) -> LoadPlan | None:
        """What seq would take from the tiers after its device match (None: nothing to do:
        the request needs prompt states, or already holds blocks)."""
        if seq.block_table or seq.params.needs_prompt_states:
            return None
        bs = self.block_size
        start = len(match.blocks)
        hashes = self._chain(seq, (seq.num_tokens - 1) // bs)
        ready = self._ready.get(seq.seq_id, {})
        run: list[tuple[str, BlockEntry | None]] = []  # after the match, in prefix order
        for h in hashes[start:]:
            found = ready.get(h) or self._find(h)
            if found is None:
                break
            run.append(found)
        explain = CacheExplain(device_tokens=match.num_tokens)
        if not run:
            return LoadPlan([], False, explain)
        self._explain_costs(explain, start * bs, run)
        if explain.decision == "recompute":
            return LoadPlan([], False, explain)
        missing = [start + i for i, (_, e) in enumerate(run) if e is None]
        if missing:
            self._fetch(seq, hashes, missing)
            return LoadPlan([], True, explain)
        return LoadPlan(self._checked(seq, hashes, start, run, explain), False, explain)

    def _find(self, h: int) -> tuple[str, BlockEntry | None] | None:
        """(tier, entry in memory or None when it must be read), from the fastest tier."""
        for tier in self.tiers:
            if tier.contains(h):
                return tier.name, tier.peek(h)
        return None

    def _explain_costs(self, explain: CacheExplain, num_context: int, run) -> None:
        blocks = Counter(name for name, _ in run)  # tier -> blocks found there
        nbytes = {t: n * self.block_nbytes for t, n in blocks.items()}
        explain.host_tokens = blocks["host"] * self.block_size
        explain.disk_tokens = blocks["disk"] * self.block_size
        explain.reload_bytes = sum(nbytes.values())
        explain.reload_s = sum(n / max(self.by_name[t].bandwidth_Bps, 1.0)
                               for t, n in nbytes.items())
        explain.tiers = {t: self.by_name[t].bandwidth_Bps for t in nbytes}
        explain.recompute_s = self.estimate.seconds(num_context, len(run) * self.block_size)
        explain.basis = self.estimate.basis
        explain.decision = decide(self.policy, explain.reload_s, explain.recompute_s)

    def _checked(self, seq, hashes: list[int], start: int, run, explain: CacheExplain):
        """The run's entries that pass verify, up to the first that does not (that block
        and the rest are recomputed; a bad entry is dropped from its tier)."""
        bs = self.block_size
        ready = self._ready.setdefault(seq.seq_id, {})
        out = []
        parent = hashes[start - 1] if start else namespace_hash(seq.extra_key)
        for i, (tier, entry) in enumerate(run, start):
            h = hashes[i]
            if h not in ready:  # entries read from disk were verified on the IO thread
                if verify(entry, h, parent, seq.token_ids[i * bs:(i + 1) * bs]) is not None:
                    self._fail(tier, h)
                    explain.failed_blocks += 1
                    break
                ready[h] = (tier, entry)
            out.append((tier, entry))
            parent = h
        return out

    def _fail(self, tier: str, h: int) -> None:
        t = self.by_name[tier]
        t.discard(h)
        t.stats.num_failed += 1
        if not any(other.contains(h) for other in self.tiers):
            self._retention.release(h)

    # -- reading from disk, off the step ------------------------------------------------------

    def _fetch(self, seq, hashes: list[int], missing: list[int]) -> None:
        if seq.seq_id in self._fetches:
            return
        bs = self.block_size
        ns = namespace_hash(seq.extra_key)
        jobs = [(hashes[i], hashes[i - 1] if i else ns,
                 tuple(seq.token_ids[i * bs:(i + 1) * bs])) for i in missing]
        self._fetches[seq.seq_id] = self.io.submit(_read_checked, self.by_name["disk"], jobs)

    def poll(self) -> None:
        """Engine thread, before scheduling: take finished reads and writes."""
        if not self.io.threaded:
            self.io.run_deferred()
        disk = self.by_name.get("disk")
        if disk is not None:
            disk.poll()
        if len(self._retention):
            self._unkeep(self._retention.expire(self._now()))
        for seq_id, future in list(self._fetches.items()):
            if not future.done():
                continue
            del self._fetches[seq_id]
            ready = self._ready.setdefault(seq_id, {})
            for h, entry, seconds in future.result():
                if entry is None:
                    self._fail("disk", h)
                    continue
                disk.observe_read(entry.num_bytes, seconds)
                ready[h] = ("disk", entry)

    @property
    def is_busy(self) -> bool:
        """Reads in flight: a waiting request will be admitted once they finish."""
        return bool(self._fetches)

    def wait(self, timeout: float) -> None:
        if self._fetches and self.io.threaded:
            concurrent.futures.wait(list(self._fetches.values()), timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    # -- admission ----------------------------------------------------------------------------

    def on_admitted(self, seq, num_matched_blocks: int, plan: LoadPlan) -> None:
        """seq was allocated blocks for plan's tokens and its chunk: queue the loads, move
        its computed tokens past them, count and record the decision."""
        explain = plan.explain
        blocks = seq.block_table[num_matched_blocks:num_matched_blocks + plan.num_blocks]
        for block, (tier, entry) in zip(blocks, plan.entries):
            self._loads.append(KVBlock(block, entry.data))
            st = self.by_name[tier].stats
            st.num_hits += 1
            st.num_hit_bytes += entry.num_bytes
        loaded = plan.num_blocks * self.block_size
        seq.num_computed_tokens += loaded
        explain.loaded_tokens = loaded
        if explain.decision == "reload":
            self.num_reload += 1
        elif explain.decision == "recompute":
            self.num_recompute += 1
        if seq.status == SequenceStatus.WAITING:  # first admission (a resume keeps the first record)
            seq.num_cached_tokens += loaded
            seq.timings.num_cached_tokens = max(seq.timings.num_cached_tokens,
                                                seq.num_cached_tokens)
            seq.timings.cache_explain = explain.to_dict()
        self.forget(seq.seq_id)

    def on_finish(self, seq, status) -> None:
        self.forget(seq.seq_id)

    def forget(self, seq_id: int) -> None:
        """seq was admitted, finished or aborted: drop what was gathered for it."""
        self._ready.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        future = self._fetches.pop(seq_id, None)
        if future is not None:
            future.cancel()

    # -- cost and metrics ---------------------------------------------------------------------

    def on_step(self, step: StepDescription, step_s: float) -> None:
        """A timed step with sequences feeds the recompute estimate."""
        if step.seqs:
            self.estimate.observe(step, step_s)

    def report(self) -> dict[str, dict]:
        return {"kv_tiers": self.stats()}

    def stats(self) -> dict[str, dict[str, float]]:
        out = {t.name: {**t.stats.to_dict(), "bandwidth_Bps": t.bandwidth_Bps}
               for t in self.tiers}
        out["decisions"] = {"reload": self.num_reload, "recompute": self.num_recompute,
                            "dropped_saves": self.num_dropped_saves}
        return out

    @property
    def num_retained_blocks(self) -> int:
        return len(self._retention)

    def check_invariants(self) -> None:
        self._retention.check_invariants()
        for tier in self.tiers:
            check = getattr(tier, "check_invariants", None)
            if check is not None:
                check()


def _touch(tier: TierStore, h: int) -> None:
    touch = getattr(tier, "touch", None)
    if touch is not None:
        touch(h)
    else:
        tier.peek(h)


def _read_checked(disk, jobs: list[tuple[int, int, tuple[int, ...]]]
                  ) -> list[tuple[int, BlockEntry | None, float]]:
    """IO thread: read and verify each block; None for a missing or failing one."""
    out = []
    for h, parent, tokens in jobs:
        entry, seconds = disk.peek(h), 0.0  # a write still queued: in memory, not timed
        if entry is None:
            t0 = time.perf_counter()
            entry = disk.read(h)
            seconds = time.perf_counter() - t0
        if entry is not None and verify(entry, h, parent, tokens) is not None:
            entry = None
        out.append((h, entry, seconds))
    return out


__all__ = ["KVTiers", "LoadPlan"]
