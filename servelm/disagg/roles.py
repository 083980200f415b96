"""The prefill and decode roles: an engine's side of KV transfers.

Owns: `PrefillRole` and `DecodeRole`, two KVConnectors (servelm/engine/kv_connector.py) an
Engine is built with (alone, or beside the KV tiers in a MultiKVConnector) and calls through
its hooks: on_add, on_abort, on_finish, poll, has_work. Everything a role does to the engine
happens on the engine's own thread, inside those hooks; transports deliver messages from
their I/O threads into the role's inbox, which `poll` drains between steps. Block contents
move only through the step contract (the engine's KVWorker: the prefill side saves blocks,
the decode side starts loads, each then waits for its KV-only step).
Never: trusts a peer (every frame is checked: transfer, index, chain hash, crc32, size),
frees a block another party may still read, or leaves a request waiting without a bound.

    router ──request──> decode worker                      prefill worker <──request── router
                          on_add: hold the request           on_add: run it (max_tokens 1)
                          match own prefix cache (dedup)     poll: pin each block as it fills
                          reserve blocks (lease) ──Pull──>   match the Pull; read the pinned
                          verify + load each frame <─KVFrame─ blocks (kv_saves), send them
                                                  <──Sent──
                          cache the blocks under the
                          prompt's chain hashes ────Ack──>   unpin (free its copy)
                          admit: a prefix hit; compute
                          only the tail, then decode

The decode side's answer to any failure is the same: the prefix it verified is cached, the
rest is computed here (a "fallback", counted by cause). The client's tokens never depend on
a byte that failed a check.
"""

from __future__ import annotations

import logging
import queue
import time

from servelm.core.contract import KVBlock
from servelm.engine.kv_connector import KVConnector, KVConnectorHost
from servelm.disagg.messages import (KV_PROTOCOL_VERSION, Ack, Cancel, KVFrame, KVHello, Pull,
                                     Sent, checksum)
from servelm.disagg.transfer import (RecvState, RecvTransfer, SendState, SendTransfer,
                                     TransferStats, TransferTimeouts)
from servelm.disagg.transport import KVTransport, make_transport
from servelm.engine.prefix_cache import block_hashes
from servelm.protocol import InvalidParameterError

logger = logging.getLogger(__name__)

_CLOSED = object()  # inbox marker: (channel, _CLOSED, reason)


class _Role(KVConnector):
    """What both roles share: the inbox, the engine (once bound) and its clock, the stats."""

    role = ""
    reads_prompt_blocks = True  # a prompt's blocks are sent or cached after they filled

    def __init__(self, transport: KVTransport, block_nbytes: int,
                 timeouts: TransferTimeouts | None = None, clock=None):
        self.name = f"{self.role}_role"
        self.transport = transport
        self.block_nbytes = block_nbytes
        self.timeouts = timeouts or TransferTimeouts()
        self.clock = clock
        self.stats = TransferStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._seen = (0, 0)  # take_changed's last (started, finished)
        self.wake = None  # set by the engine loop: a message arrived, step soon

    def bind(self, host: KVConnectorHost) -> None:
        self.host = host
        self.bm = host.block_manager
        self.block_size = self.bm.block_size
        self.clock = self.clock or host.clock

    def set_wake(self, wake) -> None:
        self.wake = wake

    # -- KVEndpoint (transport I/O threads: enqueue only) ----------------------------------

    def on_message(self, channel, msg, payload) -> None:
        self._inbox.put((channel, msg, payload))
        if self.wake is not None:
            self.wake()

    def on_closed(self, channel, reason: str) -> None:
        self._inbox.put((channel, _CLOSED, reason))
        if self.wake is not None:
            self.wake()

    def _drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def _is_ours(self, request) -> bool:
        """A request for the other role (a misrouted one) is computed here like any other:
        the hooks never refuse or raise (the engine has filed the request already)."""
        kt = request.kv_transfer
        if kt is None:
            return False
        if kt.role != self.role:
            logger.warning("request %s asks for the %s role of a KV transfer; this worker "
                           "runs %s: computed here", request.request_id, kt.role, self.role)
            return False
        return True

    def _hashes(self, tokens: list[int], extra_key, num_blocks: int) -> list[int]:
        return block_hashes(tokens[:num_blocks * self.block_size], self.block_size, extra_key)

    def report(self) -> dict[str, dict]:
        return {"kv_transfer": self.stats.as_dict()}

    def take_changed(self) -> bool:
        """Whether a transfer began or ended since the last call (the engine loop then
        publishes a report although no step ran)."""
        now = (self.stats.num_started, self.stats.num_finished)
        changed, self._seen = now != self._seen, now
        return changed


class PrefillRole(_Role):
    """Computes prompts and serves their blocks to the decode workers that pull them."""

    role = "prefill"

    def __init__(self, transport: KVTransport, address: str, block_nbytes: int,
                 timeouts: TransferTimeouts | None = None, clock=None):
        super().__init__(transport, block_nbytes, timeouts, clock)
        self._transfers: dict[str, SendTransfer] = {}
        self._by_seq: dict[int, SendTransfer] = {}
        # transfer id -> until when: decode said "not needed" before the request came
        self._cancelled: dict[str, float] = {}
        self.listener = transport.listen(address, self)
        self.address = self.listener.address

    @property
    def has_work(self) -> bool:
        return bool(self._transfers) or not self._inbox.empty()

    # -- engine hooks ----------------------------------------------------------------------

    def on_add(self, request, seqs) -> bool:
        if not self._is_ours(request):
            return False
        tid = request.kv_transfer.transfer_id
        now = self.clock()
        t = self._transfers.get(tid)
        if self._cancelled.pop(tid, None) is not None:
            return False  # the decode worker needs nothing from this one
        if t is None:
            t = self._transfers[tid] = SendTransfer(tid, SendState.AWAITING_PULL,
                                                    now + self.timeouts.pull_timeout_s,
                                                    started=now)
            self.stats.num_started += 1
            self.stats.num_in_flight += 1
        elif t.state == SendState.AWAITING_REQUEST:
            t.state = SendState.SENDING
        else:
            logger.warning("KV transfer %s is already running: request %s computed without "
                           "it", tid, request.request_id)
            return False
        seq = seqs[0]  # the decode worker runs the n continuations; one prompt is computed
        # the prefix cache's keys (an image's positions carry its content hash)
        t.seq, keys = seq, seq.cache_token_ids
        t.own_hashes = self._hashes(keys, seq.extra_key, len(keys) // self.block_size)
        self._by_seq[seq.seq_id] = t
        return False  # computed like any request

    def on_abort(self, request_id: str) -> None:
        pass  # on_finish sees the aborted sequence and sends what was computed

    def on_finish(self, seq, status) -> None:
        t = self._by_seq.pop(seq.seq_id, None)
        if t is not None:
            self._pin_filled(t, seq)  # before the engine frees the sequence's blocks
            t.is_computed = True
            t.seq = None

    def poll(self) -> None:
        now = self.clock()
        for channel, msg, payload in self._drain():
            self._handle(channel, msg, now)
        for t in list(self._transfers.values()):
            if t.seq is not None:
                self._pin_filled(t, t.seq)
        self._send_ready()
        for t in list(self._transfers.values()):
            if now > t.deadline:
                self._expire(t)
        for tid, until in list(self._cancelled.items()):
            if now > until:
                del self._cancelled[tid]

    # -- messages --------------------------------------------------------------------------

    def _handle(self, channel, msg, now: float) -> None:
        if msg is _CLOSED:
            for t in list(self._transfers.values()):
                if t.channel is channel:
                    self._end(t, SendState.CANCELLED)
            return
        if isinstance(msg, KVHello):
            channel.send(KVHello(KV_PROTOCOL_VERSION, self.role, self.block_nbytes))
            return
        t = self._transfers.get(getattr(msg, "transfer_id", None))
        if t is None:
            if isinstance(msg, Pull):
                self._early_pull(channel, msg, now)
            elif isinstance(msg, Cancel):  # before the request: it need not keep anything
                self._cancelled[msg.transfer_id] = now + self.timeouts.pull_timeout_s
            else:
                self.stats.num_late_messages += 1  # e.g. an Ack after the lease expired
            return
        if isinstance(msg, Pull):
            self._on_pull(t, channel, msg, now)
        elif isinstance(msg, Ack):
            self._end(t, SendState.DONE)
        elif isinstance(msg, Cancel):
            self._end(t, SendState.CANCELLED)

    def _early_pull(self, channel, msg: Pull, now: float) -> None:
        t = self._transfers[msg.transfer_id] = SendTransfer(
            msg.transfer_id, SendState.AWAITING_REQUEST, now + self.timeouts.pull_timeout_s,
            started=now)
        self.stats.num_started += 1
        self.stats.num_in_flight += 1
        self._on_pull(t, channel, msg, now)

    def _on_pull(self, t: SendTransfer, channel, msg: Pull, now: float) -> None:
        if t.channel is not None:
            self.stats.num_duplicate_frames += 1
            return
        t.channel, t.first_block, t.hashes = channel, msg.first_block, list(msg.hashes)
        if msg.block_nbytes != self.block_nbytes:
            channel.send(Cancel(t.transfer_id, "layout_mismatch"))
            self._end(t, SendState.CANCELLED)
            return
        if t.state == SendState.AWAITING_PULL:
            t.state = SendState.SENDING
        # Blocks the decode worker holds already (or never asked for) need no pin.
        keep = range(t.first_block, t.end)
        self._unpin(t, [i for i in t.pinned if i not in keep])
        t.deadline = now + msg.lease_ms / 1000 + self.timeouts.ack_grace_s

    # -- blocks ----------------------------------------------------------------------------

    def _pin_filled(self, t: SendTransfer, seq) -> None:
        """Pin the blocks of seq whose KV is complete (full and computed) and not pinned."""
        full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size
        full = min(full, len(seq.block_table))
        wanted = range(t.first_block, t.end) if t.channel is not None else range(full)
        new = [i for i in range(full) if i in wanted and i not in t.pinned]
        if new:
            self.bm.pin([seq.block_table[i] for i in new])
            t.pinned.update((i, seq.block_table[i]) for i in new)

    def _send_ready(self) -> None:
        """Read every pinned block that is next in line to be sent, in one KV-only step,
        and hand the frames to the channels."""
        batch: list[tuple[SendTransfer, int]] = []
        for t in self._transfers.values():
            if t.state != SendState.SENDING:
                continue
            i = t.first_block + t.num_sent
            while i < t.end and i in t.pinned:
                batch.append((t, i))
                i += 1
        if batch:
            worker = self.host.kv_worker
            worker.save_blocks([t.pinned[i] for t, i in batch])
            saved = worker.wait()
            for (t, i), block in zip(batch, saved):
                self._send_block(t, i, block.data)
        for t in list(self._transfers.values()):
            if t.state == SendState.SENDING and (t.num_sent == len(t.hashes) or (
                    t.is_computed and t.first_block + t.num_sent not in t.pinned)):
                # All asked for, or all this prompt will ever have (an aborted prefill).
                t.channel.send(Sent(t.transfer_id, t.first_block + t.num_sent))
                t.state = SendState.AWAITING_ACK

    def _send_block(self, t: SendTransfer, index: int, data: bytes) -> None:
        if t.state != SendState.SENDING:
            return
        h = t.own_hashes[index] if index < len(t.own_hashes) else -1
        if h != t.hashes[index - t.first_block]:
            t.channel.send(Cancel(t.transfer_id, "prompt_mismatch"))
            self._end(t, SendState.CANCELLED)
            return
        t.channel.send(KVFrame(t.transfer_id, index, h, checksum(data)), data)
        t.num_sent += 1
        t.num_bytes += len(data)

    def _unpin(self, t: SendTransfer, indices) -> None:
        blocks = [t.pinned.pop(i) for i in list(indices)]
        if blocks:
            self.bm.unpin(blocks)

    def _expire(self, t: SendTransfer) -> None:
        if t.state in (SendState.SENDING, SendState.AWAITING_ACK):
            self.stats.num_lease_expiries += 1
        if t.channel is not None:
            t.channel.send(Cancel(t.transfer_id, "lease_expired"))
        self._end(t, SendState.EXPIRED)

    def _end(self, t: SendTransfer, state: SendState) -> None:
        t.state = state
        self._unpin(t, list(t.pinned))
        self._transfers.pop(t.transfer_id, None)
        if t.seq is not None and self._by_seq.get(t.seq.seq_id) is t:
            del self._by_seq[t.seq.seq_id]
            t.seq = None
        if state == SendState.DONE:
            self.stats.num_completed += 1
        else:
            self.stats.fallback(state.value)
        self.stats.num_blocks += t.num_sent
        self.stats.finish(t.num_bytes, self.clock() - t.started)

    def close(self) -> None:
        """Stop serving pulls: the channels close, so every transfer ends at the next
        poll (cancelled, its blocks unpinned)."""
        self.listener.close()
        for t in self._transfers.values():
            if t.channel is not None:
                t.channel.close()


class DecodeRole(_Role):
    """Holds each disaggregated request until its prompt's blocks have arrived (or failed
    to), then admits it as a prefix-cache hit."""

    role = "decode"

    def __init__(self, transport: KVTransport, block_nbytes: int,
                 timeouts: TransferTimeouts | None = None, clock=None):
        super().__init__(transport, block_nbytes, timeouts, clock)
        self._channels: dict[str, object] = {}  # prefill KV address -> channel
        self._transfers: dict[str, RecvTransfer] = {}
        self._by_request: dict[str, RecvTransfer] = {}
        self._admitting: list[RecvTransfer] = []  # committed, pins kept until admitted

    def bind(self, host: KVConnectorHost) -> None:
        if host.block_manager.prefix_cache is None:
            raise ValueError("the decode role caches the blocks it receives: it needs the "
                             "prefix cache (drop --no-prefix-cache)")
        super().bind(host)

    @property
    def has_work(self) -> bool:
        return bool(self._transfers) or bool(self._admitting) or not self._inbox.empty()

    # -- engine hooks ----------------------------------------------------------------------

    def on_add(self, request, seqs) -> bool:
        if not self._is_ours(request):
            return False
        kt, seq = request.kv_transfer, seqs[0]
        try:
            channel = self._channel(kt.source)
        except ValueError as exc:  # a malformed address: computed here
            logger.warning("request %s: KV source %r: %s", request.request_id, kt.source, exc)
            self.stats.fallback("connect")
            return False
        cause = self._refusal(request, seq)
        num_full = (seq.num_tokens - 1) // self.block_size  # one token is left to compute
        if cause is None and num_full == 0:
            cause = "nothing_to_send"
        if cause is not None:
            channel.send(Cancel(kt.transfer_id, cause))
            self._count_refusal(cause)
            return False
        return self._start(kt.transfer_id, request.request_id, seqs, channel, num_full)

    def _refusal(self, request, seq) -> str | None:
        if request.lora_name is not None:
            return "lora"  # adapter ids differ between workers: KV would not be comparable
        if request.images:
            return "images"  # not tested across workers yet: the prompt is computed here
        if seq.params.needs_prompt_states:
            return "prompt_states"  # prompt logprobs / pooling need every position computed
        return None

    def _count_refusal(self, cause: str) -> None:
        if cause != "nothing_to_send":
            self.stats.fallback(cause)

    def _start(self, tid: str, request_id: str, seqs, channel, num_full: int) -> bool:
        seq, bs = seqs[0], self.block_size
        keys = list(seq.cache_token_ids)  # what the prefix cache files blocks under
        match = self.bm.prefix_cache.match(keys, seq.extra_key, num_full * bs,
                                           record=False)
        have = len(match.blocks)
        want = num_full - have
        self.stats.num_blocks_deduped += have
        if want == 0:
            channel.send(Cancel(tid, "cached"))  # it holds them all: nothing to move
            return False
        if want > self.bm.num_free_blocks - self.host.admission_reserve:
            channel.send(Cancel(tid, "no_blocks"))
            self.stats.fallback("no_blocks")
            return False
        self.bm.pin(match.blocks)  # the hit must survive until the import is cached
        reserved = self.bm.reserve(want)
        now = self.clock()
        hashes = self._hashes(keys, seq.extra_key, num_full)[have:]
        t = RecvTransfer(tid, request_id, seqs, keys, seq.extra_key, channel,
                         have, hashes, list(match.blocks), reserved,
                         now + self.timeouts.lease_s, now)
        self._transfers[tid] = t
        self._by_request[request_id] = t
        self.stats.num_started += 1
        self.stats.num_in_flight += 1
        channel.send(Pull(tid, have, hashes, self.block_nbytes,
                          int(self.timeouts.lease_s * 1000)))
        return True

    def _channel(self, address: str):
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.transport.connect(address, self)
            ch.send(KVHello(KV_PROTOCOL_VERSION, self.role, self.block_nbytes))
        return ch

    def on_abort(self, request_id: str) -> None:
        t = self._by_request.get(request_id)
        if t is not None and t.state == RecvState.PULLING:
            self._commit(t, "aborted")  # back to the queue, so the abort can finish it

    def on_finish(self, seq, status) -> None:
        pass  # pins are released once the request is admitted (poll)

    def poll(self) -> None:
        now = self.clock()
        for channel, msg, payload in self._drain():
            self._handle(channel, msg, payload)
        self._load_pending()
        for t in list(self._transfers.values()):
            if t.bad is not None:
                self._commit(t, t.bad)
            elif t.sent_end is not None:
                # Channels deliver in order: a frame not here when Sent is, never comes.
                if t.num_contiguous() < min(t.sent_end, t.end) - t.first_block:
                    self._commit(t, "frame_lost")
                else:
                    self._commit(t, None if t.sent_end >= t.end else "prefill_cancelled")
            elif now > t.deadline:
                self.stats.num_lease_expiries += 1
                self._commit(t, "lease_expired")
        self._release_admitted()

    # -- messages --------------------------------------------------------------------------

    def _handle(self, channel, msg, payload) -> None:
        if msg is _CLOSED:
            for address, ch in list(self._channels.items()):
                if ch is channel:
                    del self._channels[address]  # the next request reconnects
            for t in list(self._transfers.values()):
                if t.channel is channel:
                    self._commit(t, "peer_lost")
            return
        if isinstance(msg, KVHello):
            if msg.version != KV_PROTOCOL_VERSION or (
                    msg.block_nbytes and msg.block_nbytes != self.block_nbytes):
                for t in list(self._transfers.values()):
                    if t.channel is channel:
                        t.bad = "layout_mismatch"
            return
        t = self._transfers.get(getattr(msg, "transfer_id", None))
        if t is None or t.channel is not channel:
            self.stats.num_late_messages += 1  # ended already (committed): ignored
            return
        if isinstance(msg, KVFrame):
            self._on_frame(t, msg, payload)
        elif isinstance(msg, Sent):
            t.sent_end = msg.end
        elif isinstance(msg, Cancel):
            t.sent_end = t.first_block  # nothing more will come: keep what was loaded
            t.bad = t.bad or "prefill_cancelled"

    def _on_frame(self, t: RecvTransfer, msg: KVFrame, payload) -> None:
        i = msg.index
        if not t.first_block <= i < t.end:
            t.bad = "frame_lost"  # a frame we never asked for: the peer is confused
            return
        if i in t.loaded or i in t.pending:
            self.stats.num_duplicate_frames += 1
            return
        if (payload is None or len(payload) != self.block_nbytes
                or msg.hash != t.hashes[i - t.first_block] or checksum(payload) != msg.crc32):
            t.bad = "checksum"  # this block and everything after it is computed here
            return
        t.pending[i] = payload

    def _load_pending(self) -> None:
        """Write every verified block into its reserved block, in one KV-only step."""
        loads, done = [], []
        for t in self._transfers.values():
            for i, data in t.pending.items():
                loads.append(KVBlock(t.reserved[i - t.first_block], data))
                done.append((t, i))
            t.pending.clear()
        if loads:
            worker = self.host.kv_worker
            worker.start_loads(loads)
            worker.wait()
            for t, i in done:
                t.loaded.add(i)

    # -- the end of a transfer -------------------------------------------------------------

    def _commit(self, t: RecvTransfer, cause: str | None) -> None:
        """Cache the loaded prefix, release the rest, ack, admit the request."""
        if t.bad == "checksum" or t.bad == "frame_lost":
            cause = t.bad
        k = t.num_contiguous()
        chain = t.matched + t.reserved[:k]
        cached = self.bm.cache_imported(t.tokens, chain, t.extra_key, t.first_block) \
            if k else t.first_block
        kept = max(0, cached - t.first_block)
        # Blocks not filed in the cache (not loaded, after a gap, or found cached under
        # another id meanwhile) are private and empty: give them back now.
        self.bm.unpin(t.reserved[kept:])
        t.pins = t.matched + t.reserved[:kept]
        t.state = RecvState.COMMITTED
        del self._transfers[t.transfer_id]
        del self._by_request[t.request_id]
        if cause != "peer_lost":
            t.channel.send(Ack(t.transfer_id, t.first_block + kept))
        if cause is None and kept == len(t.hashes):
            self.stats.num_completed += 1
        else:
            self.stats.fallback(cause or "frame_lost")
        self.stats.num_blocks += kept
        self.stats.finish(kept * self.block_nbytes, self.clock() - t.started)
        self.host.admit(t.seqs)
        self._admitting.append(t)

    def _release_admitted(self) -> None:
        """A request's blocks stay pinned until its sequences were scheduled once (they hold
        the blocks then) or finished."""
        still = []
        for t in self._admitting:
            if all(s.is_finished or s.num_computed_tokens > 0 for s in t.seqs):
                self.bm.unpin(t.pins)
            else:
                still.append(t)
        self._admitting = still

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


def role_from_args(args, block_nbytes: int) -> _Role:
    """--role (EngineArgs.disagg_role) -> the role an engine is built with."""
    timeouts = TransferTimeouts(lease_s=args.kv_lease_s, pull_timeout_s=args.kv_lease_s)
    transport = make_transport(args.kv_transport)
    if args.disagg_role == "prefill":
        if not args.kv_address:
            raise InvalidParameterError("the prefill role needs --kv-address", "kv_address")
        role = PrefillRole(transport, args.kv_address, block_nbytes, timeouts)
        logger.info("prefill role: KV pulls on %s (%s)", role.address, transport.name)
    elif args.disagg_role == "decode":
        role = DecodeRole(transport, block_nbytes, timeouts)
        logger.info("decode role: KV pulled over %s", transport.name)
    else:
        raise InvalidParameterError(f"role must be colocated, prefill or decode, got "
                                    f"{args.disagg_role!r}", "role")
    return role


__all__ = ["DecodeRole", "PrefillRole", "role_from_args"]
