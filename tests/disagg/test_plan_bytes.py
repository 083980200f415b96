"""KV bytes a disaggregated request ships equal `servelm plan disagg` for the same model and
prompt length (a tiny real model: the engine counts its pool's block bytes, the planner
multiplies tokens by servelm.cost's KV bytes per token; two independent sources)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_engine, make_tiny_hf_model  # noqa: E402

from servelm.planner.deployment import Deployment  # noqa: E402
from servelm.planner.disagg import plan_disagg  # noqa: E402
from servelm.planner.hardware import get_accelerator, get_link  # noqa: E402
from tests.disagg.harness import request  # noqa: E402
from servelm.protocol import KVTransferParams  # noqa: E402

BLOCK = 4


def _pair(hf, dtype: str):
    kw = dict(block_size=BLOCK, dtype=dtype, max_num_batched_tokens=64, kv_transport="inproc")
    address = f"inproc://plan-{dtype}"
    prefill = make_tiny_engine(hf, disagg_role="prefill", kv_address=address, **kw)
    return prefill, make_tiny_engine(hf, disagg_role="decode", **kw), address


def _ship(prefill, decode, address, prompt_len: int, seed: int):
    """(bytes the decode side kept for this request, tokens they cover)"""
    tokens = [7 + (i * 13 + seed * 101) % 350 for i in range(prompt_len)]
    stats = decode.kv_connector.stats
    before_bytes, before_blocks = stats.num_bytes, stats.num_blocks
    tid = f"t{seed}"
    prefill.add_request(request(tokens, 1, f"p{seed}", KVTransferParams(tid, "prefill")))
    decode.add_request(request(tokens, 4, f"d{seed}", KVTransferParams(tid, "decode", address)))
    for _ in range(500):
        if not (prefill.has_unfinished or decode.has_unfinished):
            break
        for eng in (prefill, decode):
            if eng.has_unfinished:
                eng.step()
    assert stats.num_completed == seed and not stats.fallbacks
    assert prefill.kv_connector.stats.num_bytes == stats.num_bytes
    for eng in (prefill, decode):
        eng.check_invariants()
        assert eng.block_manager.num_pinned_blocks == 0
    return stats.num_bytes - before_bytes, (stats.num_blocks - before_blocks) * BLOCK


@pytest.mark.parametrize("dtype,plan_dtype", [("float32", "fp32"), ("bfloat16", "bf16")])
def test_bytes_shipped_equal_the_planner(dtype, plan_dtype):
    prefill, decode, address = _pair(make_tiny_hf_model("llama", seed=5), dtype)
    for seed, prompt_len in enumerate((64, 61), start=1):
        shipped, tokens = _ship(prefill, decode, address, prompt_len, seed)
        # Every full block but the one holding the last prompt token (decode computes it:
        # its next-token distribution is the first output).
        assert tokens == (prompt_len - 1) // BLOCK * BLOCK
        d = Deployment(decode.model_config, get_accelerator("H100-SXM"), kv_dtype=plan_dtype)
        plan = plan_disagg(d, tokens, get_link("nic-100g"))
        assert shipped == plan.kv_transfer_bytes
        # The planner's bill for the whole prompt differs by the tail decode recomputes.
        whole = plan_disagg(d, prompt_len, get_link("nic-100g")).kv_transfer_bytes
        assert whole - shipped == (prompt_len - tokens) * d.kv_bytes_per_token
    prefill.kv_connector.close()
