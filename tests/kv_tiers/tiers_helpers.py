"""Engines with KV tiers over the fake runner, for the tier tests (import as tiers_helpers)."""

from fake_runner import FakeRunner, make_engine

from servelm.kv_tiers.disk_tier import DiskTier
from servelm.kv_tiers.host_tier import HostTier
from servelm.kv_tiers.io_queue import IOQueue
from servelm.kv_tiers.tiers import KVTiers
from servelm.protocol import EngineRequest, SamplingParams

FINGERPRINT = {"model": "fake", "servelm_version": "test"}


class CheckingRunner(FakeRunner):
    """A FakeRunner that, before computing a chunk, checks every KV slot the chunk attends
    holds the token at that position: a reload into the wrong block, a block overwritten
    before it was saved or a load of another prefix's bytes fails here."""

    def __init__(self, block_size: int):
        super().__init__(block_size=block_size)
        self.num_checked_positions = 0

    def write_kv(self, s) -> None:
        seq, bs = s.seq, self.block_size
        for pos in range(s.start):
            held = self.block_tokens(seq.block_table[pos // bs])[pos % bs]
            assert held == seq.token_ids[pos], (
                f"seq {seq.seq_id} position {pos}: KV of token {held}, expected "
                f"{seq.token_ids[pos]}")
        self.num_checked_positions += s.start
        super().write_kv(s)


def tiered_engine(num_blocks=16, block_size=4, host_bytes=0, disk_dir=None, disk_bytes=0,
                  policy="always", budget=32, fingerprint=FINGERPRINT, threaded=False,
                  max_num_seqs=8):
    runner = CheckingRunner(block_size)
    io = IOQueue(threaded=threaded)
    tiers = []
    if host_bytes:
        tiers.append(HostTier(host_bytes))
    if disk_dir is not None:
        tiers.append(DiskTier(disk_dir, disk_bytes, fingerprint, io))
    kv = KVTiers(tiers, block_size, runner.block_nbytes, policy, io=io)
    engine = make_engine(num_blocks=num_blocks, block_size=block_size,
                         max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                         prefix_caching=True, runner=runner, kv_connector=kv)
    return engine, kv, runner


def run(engine, prompts, max_tokens=4, salt=None, prefix="r", check=True):
    """Run prompts (all added at once) to the end; returns ({request_id: output tokens},
    {request_id: timings}) and checks the engine's invariants after every step."""
    out = {}
    for i, prompt in enumerate(prompts):
        rid = f"{prefix}{i}"
        engine.add_request(EngineRequest(rid, list(prompt), SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, cache_salt=salt)))
        out[rid] = []
    finished = {}
    while engine.has_unfinished:
        for d in engine.step():
            out[d.request_id] += d.token_ids
            if d.timings is not None:
                finished[d.request_id] = d.timings
        if check:
            engine.check_invariants()
    return out, finished


def explain(timings):
    return timings.cache_explain or {}
