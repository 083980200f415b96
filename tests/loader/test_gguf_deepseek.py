"""DeepSeek-V2/V3 GGUF files (llama.cpp's deepseek2 architecture: latent attention tensors,
kv_b_proj whole or split into k_b/v_b as newer converters write it, leading dense layers,
shared experts, V3's sigmoid routing with its correction bias and groups), written with
gguf-py's writer and name map from tiny transformers checkpoints: the same config, logits
and greedy tokens as the checkpoint."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from servelm.config import ModelConfig
from gguf_families import add_shape, add_word_vocab, assert_matches_transformers, finish
from tiny_families import make_tiny_family_model


def _write(path, family, model, split_kv_b):
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "deepseek2")
    add_shape(w, cfg)
    w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if family == "deepseek_v3"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    add_word_vocab(w, cfg.vocab_size)
    nm = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    heads, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim

    def add(base, suffix, array):
        w.add_tensor(f"{nm.get_name(base)}.{suffix}", np.ascontiguousarray(array),
                     raw_dtype=Q.F32)

    for name, tensor in model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        base, suffix = name.rsplit(".", 1)
        if base.endswith("mlp.experts"):  # [E, 2I, H] gate|up and [E, H, I]
            inter = array.shape[1] // 2
            if suffix == "gate_up_proj":
                add(f"{base}.gate_proj", "weight", array[:, :inter])
                add(f"{base}.up_proj", "weight", array[:, inter:])
            else:
                add(f"{base}.down_proj", "weight", array)
        elif suffix == "e_score_correction_bias":
            add(f"{base}.e_score_correction", "bias", array)
        elif base.endswith("kv_b_proj") and split_kv_b:  # as newer llama.cpp converters do
            kv_b = array.reshape(heads, dn + dv, -1)
            add(base.replace("kv_b_proj", "k_b_proj"), suffix,
                kv_b[:, :dn].transpose(0, 2, 1))
            add(base.replace("kv_b_proj", "v_b_proj"), suffix, kv_b[:, dn:])
        else:
            add(base, suffix, array)
    finish(w)


@pytest.fixture(scope="module", params=[("deepseek_v2", False), ("deepseek_v3", True)],
                ids=["v2-kv_b", "v3-split-k_b-v_b"])
def deepseek_file(request, tmp_path_factory):
    family, split = request.param
    model = make_tiny_family_model(family, seed=4)
    path = tmp_path_factory.mktemp(family) / f"tiny-{family}.gguf"
    _write(path, family, model, split)
    return family, model, path


def test_config_from_metadata(deepseek_file):
    from servelm.loader import load_model_config, resolve_model

    family, model, path = deepseek_file
    got = load_model_config(resolve_model(str(path)))
    want = ModelConfig.from_hf_config(model.config.to_dict())
    for field in ("architecture", "num_layers", "hidden_size", "intermediate_size",
                  "num_heads", "num_kv_heads", "kv_lora_rank", "q_lora_rank",
                  "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "num_leading_dense_layers",
                  "norm_topk_prob", "moe_topk_method", "num_expert_groups",
                  "num_topk_groups", "routed_scaling_factor", "tie_word_embeddings"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.architecture == family and got.is_mla


def test_logits_and_greedy_match_transformers(deepseek_file):
    family, model, path = deepseek_file
    prompt = [(13 * i + 1) % 384 for i in range(20)]
    assert_matches_transformers(model, path, prompt, 10)