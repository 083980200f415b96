"""Tensor- vs data-parallel attention: weights per GPU, KV tokens per replica, step bytes.

The hand-worked numbers: DeepSeek-V3 (fp8 weights, bf16 latent cache) on 8 x H200.
  usable per GPU      141e9 x 0.9 - 2e9 = 124,900,000,000 B
  attention per layer q (7168 x 1536 + 1536 + 1536 x 128 x 192 = 48,760,320)
                      + kv_a (7168 x 576 + 512 = 4,129,280) + kv_b (512 x 128 x 256 =
                      16,777,216) + o (128 x 128 x 7168 = 117,440,512) = 187,107,328 params
  attention, 61 layers 11,413,547,008 B at 1 B/param
  total               671,026,404,352 B
  latent per token    61 x (512 + 64) x 2 = 70,272 B
"""

import json

import pytest

from servelm.planner import cli
from servelm.planner.capacity import plan_capacity
from servelm.planner.coldstart import plan_coldstart
from servelm.planner.decode import step_time
from servelm.planner.deployment import default_attention_parallel
from servelm.planner.errors import PlanInputError
from servelm.planner.fleet import Workload, size_replica
from servelm.planner.hardware import get_tier
from servelm.planner.kv import plan_kv
from servelm.planner.model_catalog import builtin_model
from servelm.planner.offload import plan_offload

ATTN = 11_413_547_008
TOTAL = 671_026_404_352
USABLE = 124_900_000_000
LATENT = 70_272


def deepseek(deploy, ap, gpu="H200"):
    return deploy("DeepSeek-V3", gpu, tp=8, weight_dtype="fp8", attention_parallel=ap)


def test_engine_default_is_dp_for_mla_only(deploy):
    assert default_attention_parallel(builtin_model("DeepSeek-V3")) == "dp"
    assert default_attention_parallel(builtin_model("Llama-3.1-70B")) == "tp"
    assert deploy("DeepSeek-V3", tp=8).attention_parallel == "dp"
    with pytest.raises(PlanInputError, match="--attention-parallel"):
        deploy(attention_parallel="ep")


def test_dp_attention_deepseek_on_8_h200_by_hand(deploy):
    # weights per GPU = 11,413,547,008 + (671,026,404,352 - 11,413,547,008) / 8
    #                 = 11,413,547,008 + 82,451,607,168 = 93,865,154,176 B
    # pool = 124.9e9 - 93,865,154,176 = 31,034,845,824 B -> floor(/ 70,272) = 441,638 tokens
    # per GPU, x 8 GPUs = 3,533,104 tokens; at 8k: floor(441,638 / 8,192) = 53 x 8 = 424.
    p = plan_capacity(deepseek(deploy, "dp"), 8, 8192)
    assert p.weight_bytes_per_gpu == ATTN + (TOTAL - ATTN) / 8 == 93_865_154_176
    assert p.kv_pool_bytes_per_gpu == USABLE - 93_865_154_176
    assert p.kv_tokens_per_replica == 8 * 441_638 == 3_533_104
    assert p.max_concurrent_users == 8 * 53
    names = [s.name for s in p.steps]
    assert {"attention_weight_bytes", "kv_tokens_per_gpu", "users_per_gpu"} <= set(names)


def test_tp_attention_deepseek_holds_one_gpus_worth(deploy):
    # weights per GPU = 671,026,404,352 / 8 = 83,878,300,544 B; pool 41,021,699,456 B; each
    # GPU holds every token's latent, so the replica holds floor(pool / 70,272) = 583,755.
    p = plan_capacity(deepseek(deploy, "tp"), 8, 8192)
    assert p.weight_bytes_per_gpu == TOTAL / 8
    assert p.kv_tokens_per_replica == (USABLE - TOTAL // 8) // LATENT == 583_755
    assert p.max_concurrent_users == 583_755 // 8192 == 71
    assert any("--attention-parallel dp" in n for n in p.notes)


def test_four_times_the_context_of_a_dense_70b(deploy):
    # Per byte of cache: 327,680 / 70,272 = 4.66x, so "four times" holds per byte.
    llama = plan_kv(builtin_model("Llama-3.1-70B")).kv_bytes_per_token
    ds = plan_kv(builtin_model("DeepSeek-V3")).kv_bytes_per_token
    assert llama / ds == pytest.approx(4.663, abs=1e-3)
    # On the same 8 x H200: the 70B (bf16, TP 8) keeps (124.9e9 - 17,638,426,624) / 40,960
    # = 2,618,690 tokens; DeepSeek's 671 GB of weights leave it 3,533,104 with dp attention
    # (1.35x, not 4x) and 583,755 with tp attention (0.22x).
    dense = plan_capacity(deploy("Llama-3.1-70B", "H200", tp=8), 8, 8192)
    assert dense.kv_tokens_per_replica == 2_618_690 and dense.max_concurrent_users == 319
    dp = plan_capacity(deepseek(deploy, "dp"), 8, 8192).kv_tokens_per_replica
    tp = plan_capacity(deepseek(deploy, "tp"), 8, 8192).kv_tokens_per_replica
    assert dp / dense.kv_tokens_per_replica == pytest.approx(1.349, abs=1e-3)
    assert tp / dense.kv_tokens_per_replica == pytest.approx(0.2229, abs=1e-3)


def test_deepseek_does_not_fit_8_h100_either_way(deploy):
    # usable 70e9 per H100 < 83.9e9 (tp) < 93.9e9 (dp) of weights per GPU.
    for ap in ("dp", "tp"):
        p = plan_capacity(deepseek(deploy, ap, gpu="H100-SXM"), 8, 4096)
        assert p.max_concurrent_users == 0 and any("does not fit" in n for n in p.notes)


def test_kv_per_gpu_and_per_replica():
    ds, qwen = builtin_model("DeepSeek-V3"), builtin_model("Qwen2.5-7B")
    # TP 8 MLA: 8 copies of the 70,272 B latent = 562,176 B of HBM per cached token.
    tp = plan_kv(ds, tp=8, attention_parallel="tp")
    assert (tp.kv_copies, tp.replica_kv_bytes_per_token) == (8, 8 * LATENT)
    dp = plan_kv(ds, tp=8)  # the default for MLA: dp
    assert dp.inputs["attention_parallel"] == "dp"
    assert (dp.kv_copies, dp.replica_kv_bytes_per_token) == (1, LATENT)
    # Qwen2.5-7B, 4 KV heads: 28 x 2 x 4 x 128 x 2 = 57,344 B/token; TP 8 splits 4 ways
    # (14,336 B per GPU) and holds 2 copies: 114,688 B per token in the replica.
    q = plan_kv(qwen, tp=8)
    assert (q.kv_bytes_per_token, q.kv_bytes_per_token_per_gpu) == (57_344, 14_336)
    assert q.replica_kv_bytes_per_token == 114_688


def test_kv_with_cards_goes_on_to_tokens_per_replica(deploy):
    d = deepseek(deploy, "dp")
    p = plan_kv(d.model, context=131072, cards=d)
    assert p.kv_tokens_per_replica == 3_533_104
    assert p.inputs["gpu"] == "H200" and "kv_pool_bytes_per_gpu" in [s.name for s in p.steps]
    assert plan_kv(d.model).kv_tokens_per_replica is None


def test_dp_decode_reads_tp_copies_of_attention_and_one_latent(deploy):
    # dp: each GPU reads its own attention weights (7 extra copies of 11.4 GB across the
    # replica) but only its own requests' latents; tp: every GPU reads every latent (8x).
    dp, tp = deepseek(deploy, "dp"), deepseek(deploy, "tp")
    a, b = step_time(dp, 64, 4096), step_time(tp, 64, 4096)
    assert a.weight_bytes - b.weight_bytes == pytest.approx(7 * ATTN)
    assert b.kv_bytes == pytest.approx(8 * a.kv_bytes)
    assert a.kv_bytes == pytest.approx(64 * (4096 + 2) * LATENT)
    assert a.flops == b.flops


def test_fleet_and_coldstart_use_the_same_split(deploy):
    d = deepseek(deploy, "dp")
    rs = size_replica(d, Workload(rps=1, input_len=4000, output_len=96), 0.5)
    assert rs.kv_tokens == 3_533_104 and rs.kv_users == 8 * (441_638 // 4096)
    # each GPU copies its 93,865,154,176 B over its own 63 GB/s PCIe Gen5 link: 1.49 s
    cs = plan_coldstart(d, get_tier("nvme"))
    assert cs.host_to_gpu_s == pytest.approx(93_865_154_176 / 63e9)


def test_cli_flag_and_default(capsys):
    assert cli.main(["plan", "capacity", "--model", "DeepSeek-V3", "--gpu", "H200",
                     "--weight-dtype", "fp8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["attention_parallel"] == "dp" and data["inputs"]["tp"] == 8
    assert data["kv_tokens_per_replica"] == 3_533_104
    assert cli.main(["plan", "kv", "--model", "DeepSeek-V3", "--tp", "8",
                     "--attention-parallel", "tp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replica_kv_bytes_per_token"] == 8 * LATENT
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "capacity", "--attention-parallel", "ep"])
    assert e.value.code == 2 and "--attention-parallel" in capsys.readouterr().err


def test_offload_reloads_a_latent_over_one_host_link(deploy):
    # A request's latent is whole on one GPU (dp) or on every GPU (tp), so it comes back over
    # one GPU's PCIe Gen5 link either way, not 8: min(ddr5 307 GB/s, 1 x 63 GB/s) = 63 GB/s;
    # 8,192 x 70,272 B = 575,668,224 B -> 9.14 ms. Llama-3.1-70B's 8-way KV uses 8 links.
    for ap in ("dp", "tp"):
        p = plan_offload(deepseek(deploy, ap), 8192, get_tier("dram"))
        assert p.tier_bandwidth_Bps == 63e9
        assert p.reload_time_s == pytest.approx(8192 * LATENT / 63e9)
    dense = plan_offload(deploy("Llama-3.1-70B", "H200", tp=8), 8192, get_tier("dram"))
    assert dense.tier_bandwidth_Bps == 307e9  # min(307, 8 x 63 = 504)
