"""A decode worker that also offloads to host memory, built from its flags over a real (tiny,
random-weight) model: `--role decode` and `--kv-host-memory-gb` give one engine both KV
connectors. Transfers complete, an imported prompt evicted from the small pool goes to
host memory and comes back from it, and every continuation equals a plain engine's."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_engine  # noqa: E402

from servelm.disagg.roles import DecodeRole, PrefillRole  # noqa: E402
from servelm.engine.kv_connector import MultiKVConnector, find_connector  # noqa: E402
from servelm.kv_tiers.tiers import KVTiers  # noqa: E402
from servelm.protocol import EngineRequest, KVTransferParams, SamplingParams  # noqa: E402

KW = {"block_size": 4, "max_num_batched_tokens": 64, "kv_transport": "inproc"}


def _request(rid, tokens, max_tokens, kv=None):
    return EngineRequest(rid, list(tokens), SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True), kv_transfer=kv)


def _drain(engines, rid):
    """Step every engine until all are done; (tokens of rid, its timings)."""
    out, timings = [], None
    for _ in range(2000):
        busy = [e for e in engines if e.has_unfinished]
        if not busy:
            return out, timings
        for e in busy:
            for d in e.step():
                if d.request_id == rid:
                    out += d.token_ids
                    timings = d.timings or timings
            e.check_invariants()
    raise AssertionError("engines still busy after 2000 steps")


def test_decode_worker_with_host_tier_over_a_tiny_model(tiny_hf):
    hf = tiny_hf("llama", seed=5)
    rng = random.Random(2)
    history = [rng.randrange(5, 380) for _ in range(120)]
    others = [[rng.randrange(5, 380) for _ in range(120)] for _ in range(2)]
    plain = make_tiny_engine(hf, num_blocks=64, **KW)
    address = "inproc://decode-with-tiers"
    prefill = make_tiny_engine(hf, disagg_role="prefill", kv_address=address, num_blocks=64,
                               **KW)
    # 40 blocks of 4 tokens: each 120-token import evicts the one before it.
    decode = make_tiny_engine(hf, disagg_role="decode", num_blocks=40,
                              kv_host_memory_gb=200 * 2048 / 1e9, kv_reload_policy="always",
                              **KW)
    kv = decode.kv_connector
    assert isinstance(kv, MultiKVConnector)
    role, tiers = find_connector(kv, DecodeRole), find_connector(kv, KVTiers)
    assert role is not None and tiers is not None
    assert isinstance(prefill.kv_connector, PrefillRole)

    want = {}
    for i, tokens in enumerate([history, *others]):
        plain.add_request(_request(f"plain{i}", tokens, 6))
        want[i], _ = _drain([plain], f"plain{i}")
        tid = f"t{i}"
        prefill.add_request(_request(f"p{i}", tokens, 1, KVTransferParams(tid, "prefill")))
        decode.add_request(_request(f"d{i}", tokens, 6,
                                    KVTransferParams(tid, "decode", address)))
        got, _ = _drain([prefill, decode], f"d{i}")
        assert got == want[i]
    assert role.stats.num_completed == 3 and not role.stats.fallbacks
    host = tiers.by_name["host"].stats
    assert host.num_stored > 0 and tiers.num_dropped_saves == 0

    decode.add_request(_request("again", history, 6))  # sent to the decode worker itself
    again, timings = _drain([decode], "again")
    assert again == want[0]
    explain = timings.cache_explain
    assert explain["host_tokens"] > 0 and explain["loaded_tokens"] > 0, explain
    assert host.num_hits == explain["loaded_tokens"] // 4
    assert decode.report().kv_transfer["num_completed"] == 3
    assert decode.report().kv_tiers["host"]["num_hits"] == host.num_hits
    prefill.kv_connector.close()
    kv.close()
