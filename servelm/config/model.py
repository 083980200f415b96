"""ModelConfig: the one description of a model's shape, normalised once.

Owns: ModelConfig and reading it from an HF config.json or GGUF metadata (dense, MoE and MLA
alike: the planner plans families the engine cannot run, and
`servelm.models.get_model_class` refuses those by name).
Never: mutated after start-up; imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
