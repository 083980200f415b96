"""A fleet simulation split over processes: the replicas in shards, one forked process each,
routed as one fleet. The result is the one a single process gives (tests/sim/test_shards.py),
in less wall time where there are cores for the shards.

Owns: run_shards (the shards' processes, their results merged into one SimResult), the
per-arrival exchange of each shard's least-loaded key through shared memory (_Board), and
whether a run can be sharded at all (can_shard).
Never: a policy or a step of its own: each shard runs fleet.py's loop (_next_step, _admit)
over its replicas, and the pick is LeastLoaded's.

How: replica g lives in shard g mod S, at position g // S there. Every shard reads the whole
arrival stream. Before an arrival, each runs the steps of its own replicas that start before
it, which are exactly the ones the one-process loop runs for them by then (replicas meet only
through routing; their steps' order among each other changes nothing). It then posts its
replicas' least key (tokens in flight, KV usage, global index) and reads the others': the
least of all is LeastLoaded's pick over the whole fleet (the same order), and only the shard
that owns that replica admits the request. After the last arrival each drains alone. A shard
that needs the prefix caches (fleet._CacheNeeded: its first preemption) stops them all, and
the run starts again with caches, as the one-process run does.

The exchange: each shard has two slots (arrival j uses slot j mod 2; a shard reaches j + 2
only after every other has posted j + 1, so after it read j) of (sequence, key). A shard
writes the key, then the sequence; a reader waits for the sequence, then reads the key. That
this order holds across cores is x86-64's memory model (stores are seen in the order made,
loads are not reordered with older loads), so can_shard says no elsewhere. A waiting shard
spins, yielding its core every 1,024 polls, and checks the stop flag the parent or a failing
shard raises. Results come back over pipes as msgspec msgpack (records, per-replica reports,
the ITL summary's exact state), never pickle.
"""

from __future__ import annotations

import mmap
import multiprocessing
import multiprocessing.connection
import os
import platform
import resource
import time
import traceback
from dataclasses import replace
from typing import Iterable

import msgspec

from servelm.bench.metrics import RequestRecord
from servelm.sim.bulk import finish_run
from servelm.sim.fleet import (ReplicaReport, SimResult, _admit, _CacheNeeded, _FirstBlocks,
                               _event_loop, _make_replica, _RouteIndex)
from servelm.sim.itl import ITLSummary


def can_shard(policy) -> bool:
    """Whether a run under `policy` can be split: its picks come from an incremental index
    whose winning key orders replicas across shards (LeastLoaded's), on a machine whose
    memory model the exchange relies on, with fork()."""
    make_index = getattr(policy, "load_index", None)
    return (make_index is not None and not getattr(policy, "reads_cached_tokens", True)
            and hasattr(type(make_index([])), "least")
            and platform.machine().lower() in ("x86_64", "amd64")
            and "fork" in multiprocessing.get_all_start_methods())


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Stopped(Exception):
    """Another shard failed, or needs the caches: this one stops where it is."""


class _Board:
    """The shards' slots in memory shared across fork: per shard and slot, (sequence,
    tokens in flight, KV usage, global index) as float64; the last value is the stop flag."""

    def __init__(self, num_shards: int):
        self._mem = mmap.mmap(-1, (num_shards * 8 + 1) * 8)  # anonymous, shared on fork
        self.v = memoryview(self._mem).cast("d")
        for i in range(0, num_shards * 8, 4):
            self.v[i] = -1.0
        self._stop = num_shards * 8
        self.v[self._stop] = 0.0

    def post(self, shard: int, j: int, key: tuple) -> None:
        v, at = self.v, (shard * 2 + (j & 1)) * 4
        v[at + 1], v[at + 2], v[at + 3] = key
        v[at] = j  # last: a reader that sees it sees the key

    def read(self, shard: int, j: int) -> tuple:
        v, at = self.v, (shard * 2 + (j & 1)) * 4
        polls = 0
        while v[at] != j:
            polls += 1
            if not polls & 1023:
                if v[self._stop]:
                    raise _Stopped
                os.sched_yield()
        return (v[at + 1], v[at + 2], v[at + 3])

    def stop(self) -> None:
        self.v[self._stop] = 1.0


class _ShardOut(msgspec.Struct, tag=True):
    records: list[tuple[int, RequestRecord]]  # (arrival number, record)
    reports: list[ReplicaReport]
    itl: bytes | None  # ITLSummary.to_bytes
    num_steps: int
    num_bulk_steps: int
    num_mixed_steps: int
    first: float  # the first arrival's send time
    last_end: float
    max_rss_kib: int


class _ShardFailed(msgspec.Struct, tag=True):
    kind: str  # "cache" (needs the prefix caches), "stopped" (by another), "error"
    error_type: str = ""
    message: str = ""
    traceback: str = ""


_decoder = msgspec.msgpack.Decoder(_ShardOut | _ShardFailed)


def run_shards(requests: Iterable, num_replicas: int, spec, cost, policy, bulk: bool,
               started: float, keep_chunk_times: bool, firsts: _FirstBlocks | None,
               num_shards: int) -> SimResult:
    """fleet._simulate's result, its replicas run in num_shards forked processes (raises
    _CacheNeeded as it does). The result has no live replicas: its replica_reports say
    what each did."""
    num_shards = min(num_shards, num_replicas)
    ctx = multiprocessing.get_context("fork")
    board = _Board(num_shards)
    procs, conns = [], []
    try:
        for k in range(num_shards):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_shard_main, name=f"servelm-sim-shard-{k}", daemon=True,
                               args=(k, num_shards, send, board, requests, num_replicas,
                                     spec, cost, policy, bulk, keep_chunk_times, firsts))
            proc.start()
            send.close()  # the shard's only: its end of file then means it exited
            procs.append(proc)
            conns.append(recv)
        outs = _gather(conns, procs, board)
    finally:
        board.stop()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    failed = [o for o in outs if isinstance(o, _ShardFailed)]
    for o in failed:
        if o.kind == "error":
            if o.error_type == "ValueError":  # a bad workload: the caller's error
                raise ValueError(o.message)
            raise RuntimeError(f"a simulation shard failed:\n{o.traceback}")
    if failed:
        raise _CacheNeeded
    return _merge(outs, started, num_shards)


def _gather(conns, procs, board: _Board) -> list:
    outs: list = [None] * len(conns)
    pending = {conn: k for k, conn in enumerate(conns)}
    while pending:
        for conn in multiprocessing.connection.wait(list(pending)):
            k = pending.pop(conn)
            try:
                outs[k] = _decoder.decode(conn.recv_bytes())
            except EOFError:  # it died (killed, out of memory) before it could say why
                procs[k].join(timeout=5)
                outs[k] = _ShardFailed("error", "RuntimeError", "",
                                       f"shard {k} exited (code {procs[k].exitcode}) "
                                       "without a result")
            if isinstance(outs[k], _ShardFailed):
                board.stop()  # the others would wait for it at the next arrival
    return outs


def _merge(outs: list[_ShardOut], started: float, num_shards: int) -> SimResult:
    records = sorted((r for o in outs for r in o.records), key=lambda r: r[0])
    reports = sorted((r for o in outs for r in o.reports), key=lambda r: r.index)
    itl = None
    if outs[0].itl is not None:
        itl = ITLSummary.from_bytes(outs[0].itl)
        for o in outs[1:]:
            itl.merge(ITLSummary.from_bytes(o.itl))
    first, last_end = outs[0].first, max(o.last_end for o in outs)
    return SimResult([r for _, r in records], [], max(last_end - first, 1e-9),
                     time.perf_counter() - started, sum(o.num_steps for o in outs),
                     sum(o.num_bulk_steps for o in outs), sum(o.num_mixed_steps for o in outs),
                     itl, reports=reports, num_shards=num_shards,
                     shard_max_rss_mb=[o.max_rss_kib / 1024 for o in outs])


def _shard_main(k: int, num_shards: int, conn, board: _Board, *run) -> None:
    """A shard's process: its run's result, or why it has none, down the pipe."""
    try:
        msg = _run_shard(k, num_shards, board, *run)
    except _CacheNeeded:
        board.stop()
        msg = _ShardFailed("cache")
    except _Stopped:
        msg = _ShardFailed("stopped")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        board.stop()
        msg = _ShardFailed("error", type(exc).__name__, str(exc), traceback.format_exc())
    conn.send_bytes(msgspec.msgpack.encode(msg))
    conn.close()


def _run_shard(k: int, num_shards: int, board: _Board, requests: Iterable, num_replicas: int,
               spec, cost, policy, bulk: bool, keep_chunk_times: bool,
               firsts: _FirstBlocks | None) -> _ShardOut:
    """fleet._simulate's loop over this shard's replicas (global index k + num_shards * i
    at position i), each arrival routed with the other shards over the board."""
    replicas = [_make_replica(g // num_shards, spec, cost)
                for g in range(k, num_replicas, num_shards)]
    lag = getattr(cost, "arrival_s", 0.0)
    records: dict[str, RequestRecord] = {}
    itl = None if keep_chunk_times else ITLSummary()
    for rep in replicas:
        rep.itl = itl
    route = _RouteIndex.make(policy, replicas)
    others = [o for o in range(num_shards) if o != k]
    inf = float("inf")

    posted: list = [None, 0]  # this shard's key for the arrival in hand, and its replica

    def post(j: int, req):
        """Post this shard's least key for arrival j; its replica is the only one here
        that j can change."""
        tokens, kv, at = route.least()
        key = (float(tokens), kv, float(at * num_shards + k))
        posted[0], posted[1] = key, at
        board.post(k, j, key)
        return replicas[at]

    def arrive(j: int, req, steps: list, order) -> None:
        """Read the other shards' keys for arrival j: the least of all admits."""
        best = own = posted[0]
        at = posted[1]
        for o in others:
            key = board.read(o, j)
            if key < best:
                best = key
        if best[0] == inf:
            raise RuntimeError("no healthy replica")
        if best is own:
            _admit(f"r{j}", req, replicas[at], records, steps, order, lag)

    first, last_end, num_steps, num_bulk = _event_loop(requests, arrive, lag, records, bulk,
                                                       itl, firsts, report=k == 0,
                                                       post=post)
    for rep in replicas:
        finish_run(rep, records)
    reports = [replace(ReplicaReport.of(rep), index=i * num_shards + k)
               for i, rep in enumerate(replicas)]
    return _ShardOut([(int(rid[1:]), rec) for rid, rec in records.items()], reports,
                     itl.to_bytes() if itl is not None else None, num_steps, num_bulk,
                     sum(r.num_mixed_steps for r in replicas), first, last_end,
                     resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


__all__ = ["can_shard", "run_shards", "usable_cpus"]
