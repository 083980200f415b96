"""Tiny random-weight transformers checkpoints of the families beyond Llama/Qwen2/Qwen3
(import as `tiny_families`); engines over them come from tiny_models.make_tiny_engine."""

# name -> (transformers config class, model class, config overrides)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 64, "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                   "head_dim": 16, "norm_topk_prob": True}),
    # Windows of 8 keys and soft-caps low enough to change every test's logits.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                "attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0,
                "tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                       "rope_theta": 1000000.0}},
                "tie_word_embeddings": True}),
    # LongRoPE: the short factors below the original 256 positions, and the attention factor;
    # a window of 16 keys.
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"original_max_position_embeddings": 256, "sliding_window": 16,
              "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0 + 0.15 * i for i in range(8)],
                                  "long_factor": [2.0 + 0.5 * i for i in range(8)],
                                  "original_max_position_embeddings": 256}}),
    # Phi-3 without a window (the 128k models): the C++ decode stack takes it
    "phi3_full": ("Phi3Config", "Phi3ForCausalLM",
                  {"original_max_position_embeddings": 256, "sliding_window": None,
                   "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                       "short_factor": [1.0 + 0.15 * i for i in range(8)],
                                       "long_factor": [2.0 + 0.5 * i for i in range(8)],
                                       "original_max_position_embeddings": 256}}),
    # MLA; V2: one q_proj, softmax routing limited to 2 of 4 groups; V3: low-rank q, sigmoid
    # scores with a correction bias, renormalised and scaled. One leading dense layer each.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    {"n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                     "num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 32,
                     "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 16, "topk_method": "group_limited_greedy", "n_group": 4,
                     "topk_group": 2, "routed_scaling_factor": 1.5, "norm_topk_prob": False}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                     "num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 32,
                     "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 16, "n_group": 4, "topk_group": 2,
                     "routed_scaling_factor": 2.5, "norm_topk_prob": True}),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM",
                   {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 256,
                                        "rope_theta": 10000.0}}),
}


def make_tiny_family_model(family: str, seed: int = 0, **overrides):
    """A random-weight transformers model of `family` (float32, eval, ~N(0, 0.08) matrices
    so greedy picks are rarely near-ties)."""
    import torch
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    kwargs = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**kwargs)
    model = getattr(transformers, model_name)(config).eval()
    # generate() never stops or masks a token: servelm's side runs with ignore_eos.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif p.dim() == 1 and p.numel() != config.hidden_size:
                p.normal_(0, 0.05)  # biases and head norms: off their trivial init
    return model
