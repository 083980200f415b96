"""Frozen configuration dataclasses, normalised once at start-up.

Owns: ModelConfig, the one description of a model's shape (from an HF config.json or GGUF
metadata; dense, MoE and MLA alike: the planner plans families the engine cannot run, and
`servelm.models.get_model_class` refuses those by name), CacheConfig, SchedulerConfig,
EngineArgs and the engine's CLI flags (their defaults read from EngineArgs).
Never: mutated after start-up (values found at run time, such as the number of KV blocks, are
passed explicitly, not written back here); imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servelm.quant import quant_method_names  # torch-free: the registry's names
from servelm.quant.int8_act import ACTIVATIONS as QUANT_ACTIVATIONS  # torch-free
from servelm.quant.int8_act import check_activations as check_quant_activations
from servelm.vision.config import VisionConfig, vision_config_from_hf  # torch-free

# HF `model_type` -> servelm model family. Families share code in models/. Other model types
# (Mixtral, Qwen-MoE, DeepSeek-V2/V3, ...) keep their model_type as `architecture`: the
# planner and the cost model read their shapes; the model build refuses them by name.
_FAMILY_BY_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
# GGUF general.architecture -> servelm family (the rest keep their GGUF name, as above).
_FAMILY_BY_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                        "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "phi3": "phi3",
                        "gemma2": "gemma2", "gemma3": "gemma3_text"}
# Which layers `{arch}.attention.sliding_window` covers, by architecture, as llama.cpp
# decides (its files do not say): every layer, or (Gemma) a fixed pattern.
_GGUF_SLIDING_LAYERS = {
    "phi3": lambda i: True,
    "gemma2": lambda i: i % 2 == 0,
    "gemma3": lambda i: (i + 1) % 6 != 0,
}
# llama.cpp renormalises the top-k routing weights per architecture (its files carry no flag
# unless `{arch}.expert_weights_norm` is written): Mixtral and Qwen3-MoE do, Qwen2-MoE not.
_GGUF_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "deepseek2": False}
_GGUF_SIGMOID_GATING = 2  # `{arch}.expert_gating_func`: 1 softmax, 2 sigmoid (DeepSeek-V3)
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")
_QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_moe")
_SANDWICH_NORM_MODEL_TYPES = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, in one normalised vocabulary.

    MoE fields are 0 for dense models: `num_leading_dense_layers` leading layers use the dense
    MLP (intermediate_size), the rest route each token to `num_experts_per_tok` of
    `num_experts` experts (plus always-on shared experts). MLA fields (DeepSeek-V2/V3) are 0
    for MHA/GQA models: K and V are re-projected from a cached latent of kv_lora_rank.
    """

    architecture: str  # model family: "llama" | "qwen2" | "qwen3", else the HF/GGUF type
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Normalised rope scaling: None, or {"rope_type": "llama3"|"linear"|..., ...params}.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # MoE
    num_experts: int = 0  # routed experts per MoE layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one routed expert's MLP width
    shared_expert_intermediate_size: int = 0  # summed over the always-on shared experts
    has_shared_expert_gate: bool = False  # a sigmoid gate [hidden -> 1] on their output
    num_leading_dense_layers: int = 0
    # MLA
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: one q_proj
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # multi-token-prediction modules stored after the decoder layers (DeepSeek-V3's
    # num_nextn_predict_layers): kept only for --speculative-method mtp
    num_mtp_layers: int = 0
    norm_topk_prob: bool = True  # renormalise a token's top-k routing weights to sum to 1
    # "greedy": top-k of softmax scores; "group_limited_greedy" (DeepSeek-V2): within the
    # num_topk_groups best of num_expert_groups groups, a group scored by its best expert;
    # "noaux_tc" (DeepSeek-V3): sigmoid scores plus a correction bias choose, groups scored by
    # their best two.
    moe_topk_method: str = "greedy"
    num_expert_groups: int = 1
    num_topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by it
    # Attention variants (0 / empty: off)
    sliding_window: int = 0  # keys a sliding-window layer attends, its own included
    # Per layer "sliding_attention" | "full_attention"; () with a window: every layer slides.
    layer_types: tuple[str, ...] = ()
    attn_logit_softcapping: float = 0.0  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float = 0.0  # the same on the output logits
    query_pre_attn_scalar: float = 0.0  # attention scale 1/sqrt(this); 0: 1/sqrt(head_dim)
    rope_local_theta: float = 0.0  # rope base of sliding-window layers (Gemma 3); 0: rope_theta
    partial_rotary_factor: float = 1.0  # the leading fraction of each head that is rotated
    sandwich_norms: bool = False  # norms after attention and the MLP too: 4 a layer (Gemma)
    # The storage type of a GGUF file's layer weights (its most common one, e.g. "Q4_1"):
    # what `--quantization gguf` keeps. "" for other checkpoints.
    gguf_weight_type: str = ""
    source: str = field(default="", compare=False)  # where the shapes were read from
    # Vision-language checkpoints: the encoder, connector and image processor
    # (servelm/vision/config.py); None for a text-only model.
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.name or self.architecture}: {name} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.name or self.architecture}: num_experts_per_tok "
                             f"{self.num_experts_per_tok} out of range 1..{self.num_experts}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sliding_layer(self, layer: int) -> bool:
        if not self.sliding_window:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    @property
    def uniform_sliding_window(self) -> int:
        """The window when every layer slides over it (Mistral-style), else 0: only then can
        a sequence's blocks below the window be freed (alternating layers still read them)."""
        if not self.sliding_window:
            return 0
        types = self.layer_types
        return self.sliding_window if all(t == "sliding_attention" for t in types) else 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_leading_dense_layers if self.is_moe else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def kv_elems_per_token_layer(self) -> int:
        """Cached elements per token per layer: K and V heads, or MLA's latent + rope key."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers (MLA: its latent and
        shared rope key); servelm.cost.kv_bytes_per_token takes a KV cache dtype name."""
        return self.num_layers * self.kv_elems_per_token_layer * dtype_bytes

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "",
                       source: str = "") -> ModelConfig:
        """Normalise a Hugging Face config.json dictionary (Llama, Qwen2/3, Mixtral,
        Qwen-MoE, DeepSeek-V2/V3, and multimodal wrappers that nest the LM under
        `text_config`). A missing or malformed field is a ValueError naming it."""
        vision, top = vision_config_from_hf(cfg), cfg
        if isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", "")}
        try:
            config = cls._from_hf(cfg, name, source)
            if vision is not None:  # the family runs the whole model, encoder included
                config = config.replace(architecture=vision.family, vision=vision,
                                        **vision.text_overrides(cfg, top))
            return config
        except KeyError as e:
            raise ValueError(f"config.json has no {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.json has a bad field: {e}") from e

    @classmethod
    def _from_hf(cls, cfg: dict[str, Any], name: str, source: str) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        family = _FAMILY_BY_MODEL_TYPE.get(model_type, model_type or "unknown")
        num_heads = int(_first(cfg, "num_attention_heads", "n_head"))
        hidden = int(_first(cfg, "hidden_size", "n_embd", "d_model"))
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_theta, rope_scaling, rope_local_theta = _hf_rope(cfg)
        num_layers = int(_first(cfg, "num_hidden_layers", "n_layer", "num_layers"))
        return cls(
            architecture=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(_first(cfg, "intermediate_size", "n_inner",
                                         default=4 * hidden)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias",
                                        model_type in _QKV_BIAS_MODEL_TYPES)),
            qk_norm=model_type in _QK_NORM_MODEL_TYPES,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name or cfg.get("_name_or_path", "") or model_type or "custom",
            source=source,
            **_hf_moe_mla(cfg),
            **_hf_attention_variants(cfg, num_layers),
            rope_local_theta=rope_local_theta,
            sandwich_norms=model_type in _SANDWICH_NORM_MODEL_TYPES,
        )

    @classmethod
    def from_gguf_metadata(cls, get: Callable[[str, Any], Any], tensor_types: dict[str, str],
                           *, name: str = "", source: str = "",
                           **extra: Any) -> ModelConfig:
        """Normalise a GGUF file's metadata (llama.cpp key names). get(key, default): one
        metadata value; tensor_types: tensor name -> ggml type name ("Q4_1", "F32", ...).
        extra: fields only the loader reads (rope_scaling, bos/eos token ids)."""
        arch = get("general.architecture", None)
        if not arch:
            raise ValueError("GGUF file has no general.architecture")

        def meta(key: str, default: Any = None) -> Any:
            value = get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata has no {arch}.{key}")
            return _scalar(value)

        hidden = meta("embedding_length")
        num_heads = meta("attention.head_count")
        key_len = meta("attention.key_length", hidden // num_heads)
        tokens = get("tokenizer.ggml.tokens", None) or []
        family = _FAMILY_BY_GGUF_ARCH.get(arch, arch)
        if arch == "llama" and meta("expert_count", 0):
            family = "mixtral"  # llama.cpp writes Mixtral as llama with experts
        elif arch == "deepseek2":  # V2 and V3 share llama.cpp's architecture; V3 gates by sigmoid
            sigmoid = get(f"{arch}.expert_gating_func", 1) == _GGUF_SIGMOID_GATING
            family = "deepseek_v3" if sigmoid else "deepseek_v2"
        return cls(
            architecture=family,
            vocab_size=len(tokens) or meta("vocab_size"),
            hidden_size=hidden,
            intermediate_size=meta("feed_forward_length", 4 * hidden),
            num_layers=meta("block_count"),
            num_heads=num_heads,
            num_kv_heads=meta("attention.head_count_kv", num_heads),
            head_dim=key_len,
            max_position_embeddings=meta("context_length", 2048),
            rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in tensor_types,
            attention_bias="blk.0.attn_q.bias" in tensor_types,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_types,
            **_gguf_sliding_window(arch, get, meta("block_count")),
            **_gguf_gemma(arch, get, hidden, num_heads, key_len, meta("block_count")),
            name=name or str(get("general.name", "") or ""),
            source=source,
            gguf_weight_type=_main_weight_type(tensor_types),
            **{**_gguf_moe_mla(meta, key_len), **_gguf_moe_routing(arch, get, tensor_types)},
            **extra,
        )


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is None:
        raise KeyError(keys[0])
    return default


def _scalar(v: Any) -> int:
    # Some GGUF files store per-layer head counts as arrays; the cache is sized by the largest.
    return int(max(v)) if isinstance(v, list) else int(v)


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling, rope_local_theta): the global layers' rope, and the base of
    sliding-window layers where it differs (Gemma 3; 0.0 otherwise)."""
    rope_scaling = cfg.get("rope_scaling")
    rope_theta = cfg.get("rope_theta")
    rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds theta in here
    local_theta = float(cfg.get("rope_local_base_freq") or 0.0)
    if isinstance(rope_params, dict) and isinstance(rope_params.get("full_attention"), dict):
        # One rope per layer type (Gemma 3): sliding layers keep plain rope at their base.
        local = rope_params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.sliding_attention.rope_type "
                             f"{local['rope_type']!r} is not supported (only 'default')")
        local_theta = float(local.get("rope_theta") or local_theta)
        rope_params = rope_params["full_attention"]
    if isinstance(rope_params, dict):
        rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
    if isinstance(rope_scaling, dict):
        rope_scaling = dict(rope_scaling)
        rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
        if rope_scaling["rope_type"] == "su":  # Phi-3's first name for LongRoPE
            rope_scaling["rope_type"] = "longrope"
        if rope_scaling["rope_type"] == "default":
            rope_scaling = None
        elif cfg.get("original_max_position_embeddings"):  # Phi-3 keeps it at the top level
            rope_scaling.setdefault("original_max_position_embeddings",
                                    cfg["original_max_position_embeddings"])
    return (float(rope_theta if rope_theta is not None else 10000.0), rope_scaling,
            local_theta)


def _default_layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Gemma 2 slides on even layers; Gemma 3 on all but every sliding_window_pattern-th;
    Qwen from layer max_window_layers on; other families (Mistral) on every layer: ()."""
    model_type = cfg.get("model_type")
    if cfg.get("max_window_layers") is not None and str(model_type).startswith("qwen"):
        slides = [i >= int(cfg["max_window_layers"]) for i in range(num_layers)]
    elif model_type == "gemma2":
        slides = [i % 2 == 0 for i in range(num_layers)]
    elif model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or 6)
        slides = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        return ()
    return tuple("sliding_attention" if s else "full_attention" for s in slides)


def _hf_attention_variants(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Sliding windows, soft-capping, the attention scale and partial rotary."""
    rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"),
                                                           dict) else {}
    window = int(cfg.get("sliding_window") or 0)
    if cfg.get("use_sliding_window") is False:  # Qwen2 configs carry a window they never use
        window = 0
    types = tuple(cfg.get("layer_types") or ()) if window else ()
    if window and not types:  # config.json files written before transformers had layer_types
        types = _default_layer_types(cfg, num_layers)
    if types and len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported "
                         "(only sliding_attention, full_attention)")
    if types and "sliding_attention" not in types:
        window, types = 0, ()
    return {
        "sliding_window": window,
        "layer_types": types,
        "attn_logit_softcapping": float(cfg.get("attn_logit_softcapping") or 0.0),
        "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 0.0),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 0.0),
        "partial_rotary_factor": float(cfg.get("partial_rotary_factor")
                                       or rope_params.get("partial_rotary_factor") or 1.0),
    }


def _hf_moe_mla(cfg: dict[str, Any]) -> dict[str, int]:
    num_experts = int(_first(cfg, "n_routed_experts", "num_local_experts", "num_experts",
                             default=0))
    moe_inter = int(_first(cfg, "moe_intermediate_size", default=0)) if num_experts else 0
    if num_experts and not moe_inter:  # Mixtral: experts use intermediate_size
        moe_inter = int(cfg["intermediate_size"])
    shared = int(_first(cfg, "shared_expert_intermediate_size", default=0))
    if not shared and cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * moe_inter
    out = {
        "num_experts": num_experts,
        "num_experts_per_tok": int(_first(cfg, "num_experts_per_tok", default=0))
        if num_experts else 0,
        "moe_intermediate_size": moe_inter,
        "shared_expert_intermediate_size": shared,
        # Qwen-MoE names its shared expert this way and gates it; DeepSeek's are ungated.
        "has_shared_expert_gate": bool(num_experts and shared
                                       and cfg.get("shared_expert_intermediate_size")),
        "num_leading_dense_layers": _leading_dense_layers(cfg) if num_experts else 0,
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        **(_hf_routing(cfg) if num_experts else {}),
    }
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                "v_head_dim"):
        out[key] = int(_first(cfg, key, default=0))
    out["num_mtp_layers"] = int(cfg.get("num_nextn_predict_layers") or 0)
    return out


_TOPK_METHODS = {"greedy": "softmax", "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}


def _hf_routing(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's routing fields; refused by name where servelm does not implement them."""
    method = cfg.get("topk_method") or ("noaux_tc" if cfg.get("model_type") == "deepseek_v3"
                                        else "greedy")
    if method not in _TOPK_METHODS:
        raise ValueError(f"topk_method {method!r} is not supported "
                         f"(supported: {sorted(_TOPK_METHODS)})")
    scoring = cfg.get("scoring_func") or _TOPK_METHODS[method]
    if scoring != _TOPK_METHODS[method]:
        raise ValueError(f"scoring_func {scoring!r} with topk_method {method!r} is not "
                         f"supported (only {_TOPK_METHODS[method]!r})")
    groups = int(cfg.get("n_group") or 1) if method != "greedy" else 1
    return {"moe_topk_method": method, "num_expert_groups": groups,
            "num_topk_groups": int(cfg.get("topk_group") or groups) if groups > 1 else 1,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0)}


def _leading_dense_layers(cfg: dict[str, Any]) -> int:
    """Dense layers before the MoE ones (DeepSeek's first_k_dense_replace, Qwen-MoE's
    mlp_only_layers when they lead); other layouts are refused, naming the field."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    if step != 1:
        raise ValueError(f"decoder_sparse_step {step} is not supported (only 1: every layer "
                         "after the leading dense ones is MoE)")
    only = sorted(int(i) for i in cfg.get("mlp_only_layers") or ())
    if only != list(range(len(only))):
        raise ValueError(f"mlp_only_layers {only} is not supported (only leading layers)")
    return int(cfg.get("first_k_dense_replace") or len(only))


def _gguf_moe_mla(meta: Callable[[str, Any], int], key_len: int) -> dict[str, int]:
    num_experts = meta("expert_count", 0)
    expert_ff = meta("expert_feed_forward_length", 0)
    kv_lora = meta("attention.kv_lora_rank", 0)
    rope_dim = meta("rope.dimension_count", 0)
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": meta("expert_used_count", 0),
        "moe_intermediate_size": expert_ff or (meta("feed_forward_length", 0)
                                               if num_experts else 0),
        "shared_expert_intermediate_size": meta("expert_shared_count", 0) * expert_ff,
        "num_leading_dense_layers": meta("leading_dense_block_count", 0),
        "kv_lora_rank": kv_lora,
        "q_lora_rank": meta("attention.q_lora_rank", 0),
        "qk_rope_head_dim": rope_dim if kv_lora else 0,
        "qk_nope_head_dim": key_len - rope_dim if kv_lora else 0,
        "v_head_dim": meta("attention.value_length", key_len) if kv_lora else 0,
    }


def _gguf_sliding_window(arch: str, get: Callable[[str, Any], Any],
                         num_layers: int) -> dict[str, Any]:
    """sliding_window and layer_types of a file; a window on an architecture whose sliding
    layers are not known here is refused, never run as full attention."""
    window = int(get(f"{arch}.attention.sliding_window", 0) or 0)
    if not window:
        return {}
    if arch not in _GGUF_SLIDING_LAYERS:
        raise ValueError(f"{arch}.attention.sliding_window ({window}) is not supported in "
                         f"GGUF files of architecture {arch!r} (load the HF checkpoint)")
    slides = [_GGUF_SLIDING_LAYERS[arch](i) for i in range(num_layers)]
    types = () if all(slides) else tuple("sliding_attention" if x else "full_attention"
                                         for x in slides)
    return {"sliding_window": window, "layer_types": types}


def _gguf_gemma(arch: str, get: Callable[[str, Any], Any], hidden: int, num_heads: int,
                head_dim: int, num_layers: int) -> dict[str, Any]:
    """Gemma 2/3 as llama.cpp reads their files: GeGLU, the soft-caps as keys, the
    attention scaled by 1/sqrt(head_dim) but 1/sqrt(hidden/heads) in the 27B models (46 and
    62 layers: query_pre_attn_scalar is not in the file), sliding layers' rope base 10,000
    unless the file names one."""
    if arch not in ("gemma2", "gemma3"):
        return {}
    big = num_layers == (46 if arch == "gemma2" else 62)
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "attn_logit_softcapping": float(get(f"{arch}.attn_logit_softcapping", 0.0) or 0.0),
        "final_logit_softcapping": float(get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
        "query_pre_attn_scalar": float(hidden // num_heads if big else head_dim),
    }
    if arch == "gemma3":
        out["rope_local_theta"] = float(get(f"{arch}.rope.freq_base_swa", 10000.0))
    return out


def _gguf_moe_routing(arch: str, get: Callable[[str, Any], Any],
                      tensor_types: dict[str, str]) -> dict[str, Any]:
    """Routing details of a MoE file that `_gguf_moe_mla` (shapes only) leaves out."""
    if not get(f"{arch}.expert_count", 0):
        return {}
    out: dict[str, Any] = {}
    norm = get(f"{arch}.expert_weights_norm", None)
    if norm is not None or arch in _GGUF_NORM_TOPK:
        out["norm_topk_prob"] = bool(_GGUF_NORM_TOPK.get(arch) if norm is None else norm)
    shared_ff = get(f"{arch}.expert_shared_feed_forward_length", None)
    if shared_ff:  # Qwen2-MoE: one shared expert of its own width
        out["shared_expert_intermediate_size"] = int(shared_ff)
    out["has_shared_expert_gate"] = "blk.0.ffn_gate_inp_shexp.weight" in tensor_types
    if (scale := get(f"{arch}.expert_weights_scale", None)) is not None:
        out["routed_scaling_factor"] = float(scale)
    if arch == "deepseek2":  # DeepSeek's routing: V3 sigmoid + bias, V2 group-limited softmax
        groups = int(get(f"{arch}.expert_group_count", 1) or 1)
        sigmoid = get(f"{arch}.expert_gating_func", 1) == _GGUF_SIGMOID_GATING
        out["moe_topk_method"] = ("noaux_tc" if sigmoid else
                                  "group_limited_greedy" if groups > 1 else "greedy")
        out["num_expert_groups"] = groups
        out["num_topk_groups"] = int(get(f"{arch}.expert_group_used_count", groups) or groups)
    return out


def _main_weight_type(tensor_types: dict[str, str]) -> str:
    """The most common ggml type of the layers' matrices (a Q4_K_M file mixes a few)."""
    counts: dict[str, int] = {}
    for tensor, kind in tensor_types.items():
        if tensor.startswith("blk.") and tensor.endswith(".weight") and "norm" not in tensor:
            counts[kind] = counts.get(kind, 0) + 1
    return max(counts, key=counts.get) if counts else ""


KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: fixed-size blocks; pool size from a memory budget."""

    block_size: int = 16
    # Bytes for the KV pool. None: `memory_fraction` of the memory free after loading weights.
    kv_cache_memory_bytes: int | None = None
    memory_fraction: float = 0.25
    # Hard cap on the number of blocks (tests use it to force preemption).
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Prefix-cache blocks one namespace (cache salt) may hold under prompt_cache_retention
    # "24h", kept ahead of others in the eviction order (0: retention off).
    max_retained_blocks: int = 512
    # "auto": blocks in the model's dtype; "fp8": float8_e4m3fn codes with a static scale per
    # layer and KV head (servelm/attention/kv_cache.py): a block takes 1 byte per element.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_retained_blocks < 0:
            raise ValueError(f"max_retained_blocks must be >= 0, got {self.max_retained_blocks}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


SCHEDULING_POLICIES = ("fcfs", "slo")


KV_RELOAD_POLICIES = ("cost", "always", "never")


@dataclass(frozen=True)
class KVTiersConfig:
    """KV tiers below the device pool (servelm/kv_tiers/, docs/kv_tiers.md): host memory and
    a directory on disk, each with its own byte limit; blocks the pool evicts move down.
    reload_policy: "cost" reloads a prefix found below the pool when its bytes over the
    tier's measured bandwidth take less than recomputing it (the step-cost model at
    `cost_model`, a `servelm bench calibrate` file, else fitted on this engine's own steps);
    "always" / "never" force one side (benchmarks)."""

    host_memory_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    reload_policy: str = "cost"
    cost_model: str | None = None

    def __post_init__(self) -> None:
        if self.host_memory_bytes < 0:
            raise ValueError(f"kv_host_memory_gb must be >= 0, got {self.host_memory_bytes} B")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise ValueError("kv_disk_dir needs a positive kv_disk_gb (the disk tier's limit)")
        if self.disk_dir is None and self.disk_bytes > 0:
            raise ValueError("kv_disk_gb needs kv_disk_dir (where the disk tier's files go)")
        if self.reload_policy not in KV_RELOAD_POLICIES:
            raise ValueError(f"kv_reload_policy must be one of {KV_RELOAD_POLICIES}, got "
                             f"{self.reload_policy!r}")

    @property
    def is_enabled(self) -> bool:
        return self.host_memory_bytes > 0 or self.disk_dir is not None


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: one token budget shared by decodes and prefill chunks."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    # Image tokens whose vision encoding may start in one step (servelm/vision/budget.py);
    # 0: no limit beyond the token budget.
    max_num_encoder_tokens: int = 2048
    # "fcfs": arrival order; "slo": by class and deadline slack, prefill chunks sized from
    # the TPOT targets, early refusal of what cannot meet its TTFT (servelm/engine/slo_policy.py)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_encoder_tokens < 0:
            raise ValueError("max_num_encoder_tokens must be >= 0 (0: no encoder budget)")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                             f"{self.scheduling_policy!r}")


SPEC_METHODS = ("ngram", "draft", "eagle3", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to `num_tokens` tokens per sequence and the
    target scores them all in one step (servelm/spec/).

    method: "ngram" (prompt lookup, no model) or "draft" (a draft model: `draft_model`, a
    smaller model with the same tokenizer; or the target itself made cheaper: its first
    `draft_layers` layers plus its head, or a copy quantized with `draft_quantization`), or
    "eagle3" (an EAGLE-3 head in `draft_model` reading the target's hidden states), or
    "mtp" (the target checkpoint's own multi-token-prediction layers, DeepSeek-V3's).
    adaptive: shrink k, or turn speculation off for a step, when the measured acceptance and
    step times say it no longer pays at the current batch size.
    """

    method: str
    num_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 2
    draft_model: str | None = None
    draft_layers: int | None = None
    draft_quantization: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if self.method == "eagle3" and (self.draft_model is None or self.draft_layers
                                        or self.draft_quantization):
            raise ValueError("speculative method 'eagle3' needs --speculative-model (an "
                             "EAGLE-3 checkpoint) and takes no --spec-draft-layers or "
                             "--spec-draft-quantization")
        if self.method == "mtp" and (self.draft_model or self.draft_layers
                                     or self.draft_quantization):
            raise ValueError("speculative method 'mtp' drafts with the target's own "
                             "multi-token-prediction layers: it takes no --speculative-model, "
                             "--spec-draft-layers or --spec-draft-quantization")
        if self.method == "draft":
            if (self.draft_model, self.draft_layers, self.draft_quantization) == (None,) * 3:
                raise ValueError("speculative method 'draft' needs --spec-draft-model, "
                                 "--spec-draft-layers or --spec-draft-quantization")
            if self.draft_layers is not None and (self.draft_model or self.draft_quantization):
                raise ValueError("spec_draft_layers drafts with the target's own layers: it "
                                 "takes no --spec-draft-model or --spec-draft-quantization")
            if self.draft_layers is not None and self.draft_layers < 1:
                raise ValueError(f"spec_draft_layers must be >= 1, got {self.draft_layers}")


@dataclass(frozen=True)
class ParallelConfig:
    """Model parallelism of one replica (servelm/parallel/, docs/parallel.md): tensor-parallel
    ranks times pipeline stages, one worker process each; with expert parallelism the
    tensor-parallel ranks hold whole experts (a share each) instead of a slice of every one."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError("enable_expert_parallel places experts across the "
                             "tensor-parallel ranks: it needs tensor_parallel_size >= 2")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


# EngineArgs.parallel_launcher's names (servelm/parallel/launcher.py) and, for "ray", Ray's
# placement group strategies (PACK: as few nodes as fit; STRICT_PACK: one node; SPREAD: one
# rank per node where it can; STRICT_SPREAD: always).
PARALLEL_LAUNCHERS = ("process", "ray")
RAY_PLACEMENTS = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build an engine, as the CLI and the Python API take it."""

    model: str
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes
    memory_fraction: float = 0.25
    num_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_retained_blocks: int = CacheConfig.max_retained_blocks
    # Vision-language models (docs/vision.md): image tokens whose encoding may start in one
    # step (0: no encoder budget), and the runner's encoder cache size in image tokens.
    max_num_encoder_tokens: int = 2048
    encoder_cache_tokens: int = 16384
    device: str = "cpu"
    # "auto": bfloat16 on a CPU that runs bfloat16 dot products (probed) for a checkpoint
    # stored in 16 bits or fewer, else float32; bfloat16 on a GPU (servelm/dtype_choice.py).
    dtype: str = "auto"
    attention_backend: str = "torch"
    cuda_graphs: bool = False  # capture decode steps (needs --device cuda, triton backend)
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    # Batch-invariant kernels: a request's tokens and logprobs do not depend on the load
    # (servelm/runner/deterministic.py, docs/determinism.md). CPU float32 or bfloat16 (the
    # model's dtype) or the GPU's Triton path; dense models.
    deterministic: bool = False
    quantization: str | None = None  # weight-only method (servelm.quant): int8, int4-g32, gguf
    # What the quantized CPU linears round activations to: "float" (float32) or "int8" (per
    # 32 values, integer dot products where the CPU runs avx512_vnni; servelm/quant/int8_act.py).
    quant_activations: str = "float"
    kv_cache_dtype: str = "auto"  # "fp8": KV blocks as float8_e4m3fn (CacheConfig)
    # servelm's C++ CPU kernels: "auto" | "kernel" | "torch", or per part, e.g.
    # "attention=torch,decode=kernel" (servelm/cpu_kernels/choice.py).
    cpu_kernels: str = "auto"
    # Keep a float model's finished parameters under $SERVELM_HOME/prepared and read them
    # back on the next start instead of dequantizing the checkpoint (servelm/loader/prepared.py).
    prepared_weights_cache: bool = True
    # Speculative decoding (servelm/spec/): None = off; "ngram" or "draft".
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    spec_ngram_max: int = 4
    spec_ngram_min: int = 2
    spec_draft_model: str | None = None
    spec_draft_layers: int | None = None
    spec_draft_quantization: str | None = None
    spec_adaptive: bool = True
    # LoRA adapters (servelm/lora/, docs/lora.md): "name=path" each, loaded at start-up;
    # enable_lora: serve adapters loaded at run time even when none is given here.
    lora_modules: tuple[str, ...] = ()
    enable_lora: bool = False
    max_loras: int = 4  # adapter slots: adapters in one step's batch, at most
    max_lora_rank: int = 16  # the largest r an adapter may have (slot buffers are this wide)
    # KV tiers below the device pool (KVTiersConfig, docs/kv_tiers.md); 0 / None: off.
    kv_host_memory_gb: float = 0.0
    kv_disk_dir: str | None = None
    kv_disk_gb: float = 0.0
    kv_reload_policy: str = "cost"
    kv_tiers_cost_model: str | None = None
    # Prefill/decode disaggregation (servelm/disagg/, docs/disaggregation.md): this engine's
    # role, the KV transport by name, where a prefill worker listens for pulls (""): from the
    # HTTP port, servelm/disagg/transport.py default_address) and the decode side's lease.
    disagg_role: str = "colocated"
    kv_transport: str = "tcp"
    kv_address: str = ""
    kv_lease_s: float = 30.0
    # The scheduler's policy (SchedulerConfig.scheduling_policy) and, for "slo", the step-cost
    # model (a `servelm bench calibrate` file) it sizes chunks and predicts TTFTs with.
    scheduling_policy: str = "fcfs"
    slo_cost_model: str | None = None
    # A JSON-lines file of every step's shape and wall time, start to next start
    # (servelm/engine/step_trace.py): what `servelm bench calibrate --served-steps` fits.
    step_trace: str | None = None
    # Model parallelism (ParallelConfig, servelm/parallel/): worker processes per replica.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # "host:port": the workers are started elsewhere (torchrun-style environment variables,
    # Ray; docs/parallel.md) and join rank 0 there; None: rank 0 starts them on this machine.
    parallel_master: str | None = None
    # How rank 0 starts the other ranks (PARALLEL_LAUNCHERS): "process", child processes on
    # this machine; "ray", Ray actors in one placement group of a bundle per rank
    # (servelm/parallel/ray_launcher.py), placed by Ray's strategy parallel_placement.
    parallel_launcher: str = "process"
    parallel_placement: str = "PACK"

    def __post_init__(self) -> None:
        self.cpu_kernel_choice()  # a bad value is an error here, not deep in a layer
        check_quant_activations(self.quant_activations)
        self.kv_tiers_config()  # likewise the KV tier flags (--kv-disk-dir needs --kv-disk-gb)
        self.check_parallel_launcher()
        if self.slo_cost_model is not None and self.scheduling_policy != "slo":
            raise ValueError("slo_cost_model: the step-cost model is for --scheduling-policy "
                             f"slo, not {self.scheduling_policy!r}")
        if not isinstance(self.lora_modules, tuple):  # argparse: a list, or None
            mods = self.lora_modules
            object.__setattr__(self, "lora_modules",
                               (mods,) if isinstance(mods, str) else tuple(mods or ()))
        self.lora_adapters()

    @property
    def is_lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def lora_adapters(self) -> list[tuple[str, str]]:
        """--lora name=path entries as (name, path)."""
        out = []
        for item in self.lora_modules or ():
            name, sep, path = str(item).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora: expected name=path, got {item!r}")
            out.append((name.strip(), path.strip()))
        return out

    def cpu_kernel_choice(self):
        from servelm.cpu_kernels.choice import CpuKernelChoice  # torch-free

        return CpuKernelChoice.parse(self.cpu_kernels)

    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative_method is None:
            return None
        return SpeculativeConfig(self.speculative_method, self.num_speculative_tokens,
                                 self.spec_ngram_max, self.spec_ngram_min,
                                 self.spec_draft_model, self.spec_draft_layers,
                                 self.spec_draft_quantization, self.spec_adaptive)

    def check_parallel_launcher(self) -> None:
        if self.parallel_launcher not in PARALLEL_LAUNCHERS:
            raise ValueError(f"parallel_launcher: {self.parallel_launcher!r} is not one of "
                             f"{PARALLEL_LAUNCHERS}")
        if self.parallel_placement not in RAY_PLACEMENTS:
            raise ValueError(f"parallel_placement: {self.parallel_placement!r} is not one of "
                             f"{RAY_PLACEMENTS}")

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                              self.enable_expert_parallel)

    def kv_tiers_config(self) -> KVTiersConfig:
        return KVTiersConfig(int(self.kv_host_memory_gb * 1e9), self.kv_disk_dir,
                             int(self.kv_disk_gb * 1e9), self.kv_reload_policy,
                             self.kv_tiers_cost_model)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size,
                           kv_cache_memory_bytes=self.kv_cache_memory,
                           memory_fraction=self.memory_fraction,
                           num_blocks_override=self.num_blocks,
                           enable_prefix_caching=self.enable_prefix_caching,
                           max_retained_blocks=self.max_retained_blocks,
                           kv_cache_dtype=self.kv_cache_dtype)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                               max_num_seqs=self.max_num_seqs,
                               max_num_encoder_tokens=self.max_num_encoder_tokens,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               scheduling_policy=self.scheduling_policy)


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2GB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    s = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    return int(s)


def _default(name: str) -> Any:
    """EngineArgs' default for a field: the flags never repeat the dataclass's literals."""
    return _ENGINE_DEFAULTS[name]


_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}


def _cpu_kernels_arg(text: str) -> str:
    import argparse

    from servelm.cpu_kernels.choice import CpuKernelChoice

    try:
        CpuKernelChoice.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_engine_cli_args(parser) -> None:
    """Engine flags shared by `generate`, `chat`, `serve` and `bench`; defaults from
    EngineArgs."""
    d = _default
    g = parser.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=d("max_model_len"))
    g.add_argument("--block-size", type=int, default=d("block_size"))
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=d("kv_cache_memory"),
                   help="bytes for the KV cache, e.g. 2GiB (default: a fraction of free memory)")
    g.add_argument("--memory-fraction", type=float, default=d("memory_fraction"),
                   help="share of free memory for the KV cache when --kv-cache-memory is unset")
    g.add_argument("--max-num-seqs", type=int, default=d("max_num_seqs"))
    g.add_argument("--max-num-batched-tokens", type=int, default=d("max_num_batched_tokens"))
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   default=d("enable_chunked_prefill"))
    g.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false",
                   default=d("enable_prefix_caching"),
                   help="disable prefix caching (for comparison)")
    g.add_argument("--prompt-cache-retention-blocks", dest="max_retained_blocks", type=int,
                   default=d("max_retained_blocks"),
                   help="prefix-cache blocks one namespace (cache salt) may keep ahead of "
                        "others for requests with prompt_cache_retention 24h (0: off)")
    g.add_argument("--max-num-encoder-tokens", type=int, default=d("max_num_encoder_tokens"),
                   help="vision models: image tokens whose encoding may start in one step, so "
                        "a burst of images cannot stall decoding (0: no limit; default "
                        "%(default)s)")
    g.add_argument("--encoder-cache-tokens", type=int, default=d("encoder_cache_tokens"),
                   help="vision models: image embeddings kept by content hash, in tokens "
                        "(default %(default)s)")
    g.add_argument("--scheduling-policy", default=d("scheduling_policy"),
                   choices=list(SCHEDULING_POLICIES),
                   help="fcfs: arrival order; slo: by SLO class and deadline slack, chunks "
                        "sized from the TPOT targets, early 429 for a TTFT that cannot be met "
                        "(docs/slo.md; default %(default)s)")
    g.add_argument("--slo-cost-model", default=d("slo_cost_model"), metavar="FILE",
                   help="step-cost model (`servelm bench calibrate`) the slo policy sizes "
                        "chunks and predicts TTFTs with; without one it only orders the queue")
    g.add_argument("--step-trace", default=d("step_trace"), metavar="FILE",
                   help="write each step's shape and wall time (start to next start) to FILE, "
                        "as JSON lines, for `servelm bench calibrate --served-steps` (docs/sim.md)")
    g.add_argument("--device", default=d("device"))
    g.add_argument("--dtype", default=d("dtype"),
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype; auto: bfloat16 where the CPU runs bfloat16 dot products "
                        "(checked at start-up) and the checkpoint is stored in 16 bits or "
                        "fewer, else float32; on a GPU bfloat16 (default %(default)s)")
    g.add_argument("--attention-backend", default=d("attention_backend"),
                   choices=["torch", "triton"])
    g.add_argument("--cuda-graphs", action="store_true", default=d("cuda_graphs"),
                   help="capture decode steps as CUDA graphs (GPU, triton backend)")
    g.add_argument("--engine-seed", dest="seed", type=int, default=d("seed"),
                   help="seed of the stream unseeded requests sample from")
    g.add_argument("--threads", dest="num_threads", type=int, default=d("num_threads"))
    g.add_argument("--deterministic", action="store_true", default=d("deterministic"),
                   help="batch-invariant kernels: the same request gives the same tokens and "
                        "logprobs whatever the batch, chunking, prefix-cache hits, preemption "
                        "or speculation (CPU: float32 or bfloat16; GPU: attention backend "
                        "'triton'; dense models; docs/determinism.md)")
    g.add_argument("--quantization", default=d("quantization"), choices=quant_method_names(),
                   help="quantization of the linear layers: weight-only int8/int4; 'gguf' "
                        "keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks as they are; 'gguf-mixed' "
                        "uses them for steps of a few rows and their bf16 values for larger "
                        "ones (docs/quantization.md); 'fp8' is W8A8 "
                        "on CUDA sm89+ GPUs (default: float)")
    g.add_argument("--quant-activations", default=d("quant_activations"),
                   choices=list(QUANT_ACTIVATIONS),
                   help="quantized layers on the CPU: 'int8' rounds activations to int8 per 32 "
                        "values and multiplies with integer dot products (where the CPU runs "
                        "avx512_vnni, else float; docs/quantization.md has its accuracy cost), "
                        "'float' keeps float32 (default %(default)s)")
    g.add_argument("--kv-cache-dtype", default=d("kv_cache_dtype"),
                   choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: 'auto' = the model's --dtype; 'fp8' = e4m3 codes "
                        "with a scale per layer and KV head (half the bytes of bf16)")
    g.add_argument("--cpu-kernels", type=_cpu_kernels_arg, default=d("cpu_kernels"),
                   metavar="MODE|PART=MODE,...",
                   help="servelm's C++ CPU kernels: 'auto' (where they build, else torch), "
                        "'kernel' (or an error), 'torch' (never); per part, e.g. "
                        "'attention=torch,decode=kernel' (parts: attention, decode, "
                        "layer_ops, quant, gemm (float32 decode steps on servelm's panel "
                        "GEMM); default %(default)s). The start-up log (-v) says "
                        "which path each part took")
    g.add_argument("--no-prepared-weights-cache", dest="prepared_weights_cache",
                   action="store_false", default=d("prepared_weights_cache"),
                   help="load the checkpoint every start instead of the float parameters "
                        "prepared at the last one ($SERVELM_HOME/prepared; docs/server.md)")
    pa = parser.add_argument_group("model parallelism (docs/parallel.md)")
    pa.add_argument("--tensor-parallel-size", type=int,
                    default=d("tensor_parallel_size"), metavar="N",
                    help="shard every layer over N worker processes (torch.distributed: gloo "
                         "on the CPU, cores split between them; NCCL on GPUs)")
    pa.add_argument("--pipeline-parallel-size", type=int,
                    default=d("pipeline_parallel_size"), metavar="M",
                    help="split the layers into M stages of --tensor-parallel-size workers each")
    pa.add_argument("--enable-expert-parallel", action="store_true",
                    default=d("enable_expert_parallel"),
                    help="MoE: place whole experts across the tensor-parallel ranks (tokens "
                         "dispatched and combined by all-to-all) instead of slicing each")
    pa.add_argument("--parallel-master", default=d("parallel_master"), metavar="HOST:PORT",
                    help="the workers are started elsewhere (other machines: torchrun-style "
                         "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or Ray) and join this "
                         "rank 0 at HOST:PORT (default: rank 0 starts them here)")
    pa.add_argument("--parallel-launcher", choices=PARALLEL_LAUNCHERS,
                    default=d("parallel_launcher"),
                    help="how rank 0 starts the other ranks: process (child processes on "
                         "this machine) or ray (Ray actors in one placement group over the "
                         "cluster: $RAY_ADDRESS or one started here; docs/parallel.md)")
    pa.add_argument("--parallel-placement", choices=RAY_PLACEMENTS,
                    default=d("parallel_placement"),
                    help="with --parallel-launcher ray: the placement group's strategy "
                         "(PACK: as few nodes as fit; STRICT_PACK: one node; SPREAD: one "
                         "rank per node where it can; STRICT_SPREAD: always)")
    lo = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    lo.add_argument("--lora", dest="lora_modules", action="append", default=None,
                    metavar="NAME=PATH",
                    help="serve the PEFT adapter at PATH as model NAME (repeatable)")
    lo.add_argument("--enable-lora", action="store_true", default=d("enable_lora"),
                    help="accept adapters loaded at run time (implied by --lora)")
    lo.add_argument("--max-loras", type=int, default=d("max_loras"),
                    help="adapter slots: distinct adapters in one step (default %(default)s)")
    lo.add_argument("--max-lora-rank", type=int, default=d("max_lora_rank"),
                    help="largest adapter rank r accepted (default %(default)s)")
    kv = parser.add_argument_group("KV tiers below the device pool (docs/kv_tiers.md)")
    kv.add_argument("--kv-host-memory-gb", type=float, default=d("kv_host_memory_gb"),
                    help="host memory for KV blocks evicted from the device pool (GB; "
                         "default %(default)s: off)")
    kv.add_argument("--kv-disk-dir", default=d("kv_disk_dir"),
                    help="directory for KV blocks evicted from host memory, kept across "
                         "restarts of the same model and servelm version")
    kv.add_argument("--kv-disk-gb", type=float, default=d("kv_disk_gb"),
                    help="most bytes the disk tier's files take (GB)")
    kv.add_argument("--kv-reload-policy", default=d("kv_reload_policy"),
                    choices=list(KV_RELOAD_POLICIES),
                    help="a prefix found below the pool: reload it when that is cheaper "
                         "than recomputing it ('cost'), or always / never")
    kv.add_argument("--kv-tiers-cost-model", default=d("kv_tiers_cost_model"),
                    metavar="PATH",
                    help="step-cost model (servelm bench calibrate) for the recompute "
                         "estimate (default: fitted on this engine's own steps)")
    dg = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    dg.add_argument("--role", dest="disagg_role", default=d("disagg_role"),
                    choices=["colocated", "prefill", "decode"],
                    help="prefill: compute prompts and serve their KV blocks to decode "
                         "workers; decode: pull a request's prompt KV from the prefill worker "
                         "the router names, then decode (default %(default)s: both here)")
    dg.add_argument("--kv-transport", default=d("kv_transport"),
                    help="how KV blocks move: tcp (any two hosts), shm (same host, shared "
                         "memory) or inproc (one process) (default %(default)s)")
    dg.add_argument("--kv-address", default=d("kv_address"), metavar="ADDR",
                    help="prefill role: where decode workers pull KV from, tcp://HOST:PORT "
                         "or shm:///path.sock (default: the HTTP port + 1000 on tcp)")
    dg.add_argument("--kv-lease-s", type=float, default=d("kv_lease_s"),
                    help="decode role: seconds blocks reserved for a transfer wait for it "
                         "before the prompt is computed here instead (default %(default)s)")
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", default=d("speculative_method"), choices=SPEC_METHODS,
                   help="propose tokens with an n-gram lookup, a draft model, an EAGLE-3 "
                        "head or the model's own multi-token-prediction layers (mtp: "
                        "DeepSeek-V3) and verify them in one target step (default: off)")
    s.add_argument("--num-speculative-tokens", type=int, default=d("num_speculative_tokens"),
                   help="most draft tokens per sequence and step (k)")
    s.add_argument("--spec-ngram-max", type=int, default=d("spec_ngram_max"))
    s.add_argument("--spec-ngram-min", type=int, default=d("spec_ngram_min"))
    s.add_argument("--spec-draft-model", "--speculative-model", default=d("spec_draft_model"),
                   help="draft model (cached name, GGUF file, HF dir or ORG/NAME; same "
                        "tokenizer), or for eagle3 the EAGLE-3 head's directory")
    s.add_argument("--spec-draft-layers", type=int, default=d("spec_draft_layers"),
                   help="draft with the target's own first N layers and its head")
    s.add_argument("--spec-draft-quantization", default=d("spec_draft_quantization"),
                   choices=quant_method_names(),
                   help="draft with a copy of the target (or --spec-draft-model) quantized so")
    s.add_argument("--no-spec-adaptive", dest="spec_adaptive", action="store_false",
                   default=d("spec_adaptive"),
                   help="always speculate k tokens, even past the break-even batch")


def engine_args_from_cli(args) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(args).items() if k in names})
