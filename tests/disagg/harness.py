"""A prefill engine and a decode engine over a KV transport, stepped by the test.

Both run FakeRunners that keep per-slot token ids (tests/fake_runner.py), checked here
before every computed token: a sequence that would attend over a slot holding anything but
its own token at that position samples POISON instead, so a wrong KV byte becomes a wrong
token that the comparison with a colocated engine catches.
"""

from __future__ import annotations

import itertools

from servelm.disagg.roles import DecodeRole, PrefillRole
from servelm.disagg.transfer import TransferTimeouts
from servelm.disagg.transport import InProcTransport
from servelm.engine.kv_connector import combine
from servelm.protocol import EngineRequest, KVTransferParams, SamplingParams
from tests.fake_runner import FakeRunner, make_engine

POISON = 3
BLOCK = 4
_ids = itertools.count()


class CheckingRunner(FakeRunner):
    def __init__(self, **kw):
        super().__init__(block_size=BLOCK, **kw)
        self.poisoned: set[int] = set()
        self.num_bad_reads = 0

    def check_slots(self, s) -> None:
        super().check_slots(s)
        seq = s.seq
        for pos in range(s.start):
            block = seq.block_table[pos // BLOCK]
            if self.block_tokens(block)[pos % BLOCK] != seq.token_ids[pos]:
                self.poisoned.add(seq.seq_id)
                self.num_bad_reads += 1
                return

    def execute(self, step):
        result = super().execute(step)
        for sampled in result.sampled:
            if sampled.seq_id in self.poisoned:
                sampled.token_id = POISON
        return result


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine(num_blocks=64, kv_connector=None, **kw):
    return make_engine(num_blocks=num_blocks, block_size=BLOCK, prefix_caching=True,
                       runner=CheckingRunner(), kv_connector=kv_connector, **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [10 + (seed * 7919 + i * 31) % 900 for i in range(n)]


def request(tokens, max_tokens=6, rid=None, kv=None, **params) -> EngineRequest:
    return EngineRequest(rid or f"r{next(_ids)}", list(tokens),
                         SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                         kv_transfer=kv)


class Pair:
    """prefill + decode engines built with their roles, over `transport` (inproc by
    default). decode_extra: more KV connectors for the decode engine beside its role
    (a callable returning them, e.g. host-memory tiers), composed in a MultiKVConnector."""

    def __init__(self, transport=None, decode_transport=None, timeouts=None,
                 num_blocks=64, decode_blocks=None, decode_extra=None):
        self.clock = Clock()
        self.timeouts = timeouts or TransferTimeouts(lease_s=5.0, pull_timeout_s=5.0,
                                                     ack_grace_s=1.0)
        self.address = f"inproc://prefill-{next(_ids)}"
        transport = transport or InProcTransport()
        self.p_role = PrefillRole(transport, self.address, 8 * BLOCK, self.timeouts,
                                  self.clock)
        self.d_role = DecodeRole(decode_transport or transport, 8 * BLOCK, self.timeouts,
                                 self.clock)
        decode_kv = combine([self.d_role, *(decode_extra() if decode_extra else [])])
        self.prefill = engine(num_blocks, self.p_role)
        self.decode = engine(decode_blocks or num_blocks, decode_kv)
        self.prefill_alive = self.decode_alive = True
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}

    def submit(self, tokens, max_tokens=6, tid=None, **params) -> str:
        tid = tid or f"t{next(_ids)}"
        self.prefill.add_request(request(tokens, 1, f"p-{tid}",
                                         KVTransferParams(tid, "prefill")))
        self.decode.add_request(request(tokens, max_tokens, f"d-{tid}",
                                        KVTransferParams(tid, "decode", self.p_role.address),
                                        **params))
        self.outputs[f"d-{tid}"] = []
        return f"d-{tid}"

    def step(self, dt: float = 0.01) -> None:
        self.clock.now += dt
        if self.prefill_alive and self.prefill.has_unfinished:
            self.prefill.step()
        if self.decode_alive and self.decode.has_unfinished:
            for d in self.decode.step():
                self.outputs[d.request_id].extend(d.token_ids)
                if d.finish_reason is not None:
                    self.finished[d.request_id] = d.finish_reason.value

    def run(self, max_steps: int = 2000, dt: float = 0.01, until=None) -> int:
        """Step both until nothing is left (or `until()`); returns the steps taken.
        A request still unfinished after max_steps is a stuck request: the test fails."""
        for i in range(max_steps):
            busy = (self.prefill_alive and self.prefill.has_unfinished) or (
                self.decode_alive and self.decode.has_unfinished)
            if not busy or (until is not None and until()):
                return i
            self.step(dt)
        raise AssertionError(f"still busy after {max_steps} steps: stuck "
                             f"(decode {self.decode.num_requests} requests, prefill "
                             f"{self.prefill.num_requests})")

    def check_clean(self) -> None:
        """No leaked block, pin or sequence on either live side."""
        for alive, eng in ((self.prefill_alive, self.prefill), (self.decode_alive,
                                                                 self.decode)):
            if not alive:
                continue
            eng.check_invariants()
            assert eng.block_manager.num_pinned_blocks == 0
            assert not eng.scheduler.live_sequences()
            assert not eng.kv_connector.has_work
            assert eng.num_requests == 0


def colocated(prompts_and_max, **params) -> list[list[int]]:
    """The same requests on one plain engine: the tokens disaggregation must match."""
    eng = engine()
    ids = []
    for tokens, max_tokens in prompts_and_max:
        r = request(tokens, max_tokens, **params)
        eng.add_request(r)
        ids.append(r.request_id)
    out = {rid: [] for rid in ids}
    while eng.has_unfinished:
        for d in eng.step():
            out[d.request_id].extend(d.token_ids)
    assert POISON not in sum(out.values(), [])
    return [out[rid] for rid in ids]
