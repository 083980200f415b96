import pytest

from servelm.planner.capacity import plan_capacity
from servelm.planner.errors import PlanInputError


def test_llama_70b_on_8_h100_by_hand(deploy):
    # usable 80e9 x 0.9 - 2e9 = 70e9; weights 141.1e9 / 8; KV 320 KiB / 8 per GPU.
    p = plan_capacity(deploy("Llama-3.1-70B", tp=8), num_gpus=8, context=8192)
    pool = 70e9 - 70_553_706_496 * 2 / 8
    tokens = int(pool // (327_680 / 8))
    assert p.kv_token_capacity == tokens
    assert p.max_concurrent_users == tokens // 8192
    assert p.num_replicas == 1


def test_replicas_multiply_and_duplicate_weights(deploy):
    one = plan_capacity(deploy("Llama-3.1-8B", tp=8), 8, 4096)
    eight = plan_capacity(deploy("Llama-3.1-8B", tp=1), 8, 4096)
    assert eight.num_replicas == 8
    assert eight.max_concurrent_users == 8 * eight.users_per_replica
    # TP=8 stores the weights once instead of 8 times, so it holds more KV overall.
    assert one.kv_token_capacity > eight.kv_token_capacity


def test_mla_latent_is_not_sharded_by_tp(deploy):
    tp8 = plan_capacity(deploy("DeepSeek-V3", "H200", tp=8, weight_dtype="fp8",
                               attention_parallel="tp"), 8, 4096)
    per_gpu = 61 * 576 * 2  # whole latent on every rank
    assert tp8.kv_tokens_per_replica == int(tp8.kv_pool_bytes_per_gpu // per_gpu)


def test_tp_beyond_kv_heads_replicates(deploy):
    # Qwen2.5-7B has 4 KV heads: at TP 8 each rank still holds one head (2x duplication).
    p = plan_capacity(deploy("Qwen2.5-7B", tp=8), 8, 1024)
    per_gpu = 28 * 2 * 128 * 2  # one KV head per rank
    assert p.kv_tokens_per_replica == int(p.kv_pool_bytes_per_gpu // per_gpu)
    assert any("duplicate" in n for n in p.notes)


def test_weights_that_do_not_fit_give_zero_users(deploy):
    p = plan_capacity(deploy("Llama-3.1-405B", tp=1), 1, 1024)
    assert p.max_concurrent_users == 0 and p.kv_pool_bytes_per_gpu == 0
    assert any("does not fit" in n for n in p.notes)


def test_mem_util_and_reserve_move_capacity(deploy):
    base = plan_capacity(deploy(tp=1), 1, 2048).kv_token_capacity
    assert plan_capacity(deploy(tp=1, mem_util=0.8), 1, 2048).kv_token_capacity < base
    assert plan_capacity(deploy(tp=1, reserve_gb=0), 1, 2048).kv_token_capacity > base


def test_tp_must_divide_gpus(deploy):
    with pytest.raises(PlanInputError, match="--tp"):
        plan_capacity(deploy(tp=3), 8, 1024)
    with pytest.raises(PlanInputError, match="--mem-util"):
        deploy(mem_util=1.5)
