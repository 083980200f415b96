"""VisionConfig: what servelm knows of a vision-language checkpoint beyond its text decoder.

Owns: the family's name, the image placeholder token and the text a chat message's image part
renders to, the vision encoder's config.json section and the image processor's settings
(preprocessor_config.json), kept as JSON text so that the frozen ModelConfig stays hashable
and crosses the engine-core codec as plain data.
Never: imports torch or numpy; reads files (servelm/loader/hf_loader.py passes the
processor's JSON in).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

# HF top-level model_type -> (servelm family, the text a chat image part renders to). The
# prompt text is what the family's own chat template writes for an image part; its
# placeholder token is then repeated once per image token (servelm/vision/prompt.py).
VISION_FAMILIES = {
    "qwen2_vl": ("qwen2_vl", "<|vision_start|><|image_pad|><|vision_end|>"),
    "llava": ("llava", "<image>"),
}


@dataclass(frozen=True)
class VisionConfig:
    family: str  # "qwen2_vl" | "llava"
    image_token_id: int  # the placeholder token image embeddings replace
    image_prompt: str  # text an image content part becomes in the rendered chat prompt
    encoder_json: str  # the checkpoint's vision_config (and the connector's fields), as JSON
    processor_json: str = "{}"  # preprocessor_config.json ({}: the family's defaults)
    # Qwen2-VL's M-RoPE: how many rotary frequencies follow the temporal, height and width
    # position of a token (a text token's three positions are equal); () for 1-D positions.
    mrope_section: tuple[int, ...] = ()

    @property
    def encoder(self) -> dict[str, Any]:
        return json.loads(self.encoder_json)

    @property
    def processor(self) -> dict[str, Any]:
        return json.loads(self.processor_json)

    def text_overrides(self, text_cfg: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig fields the text section leaves implicit for this family: a tied head
        declared only at the top level (Qwen2-VL-2B), Qwen2's biased q/k/v projections, and
        M-RoPE's rope_scaling, which is VisionConfig.mrope_section here, not a scaling."""
        out: dict[str, Any] = {}
        if "tie_word_embeddings" not in text_cfg and "tie_word_embeddings" in top:
            out["tie_word_embeddings"] = bool(top["tie_word_embeddings"])
        if self.family == "qwen2_vl":
            out["attention_bias"] = bool(text_cfg.get("attention_bias", True))
            rope = text_cfg.get("rope_scaling") or text_cfg.get("rope_parameters") or {}
            kind = rope.get("rope_type") or rope.get("type") or "default"
            if kind not in ("default", "mrope"):
                raise ValueError(f"qwen2_vl: rope type {kind!r} is not supported (M-RoPE only)")
            out["rope_scaling"] = None
        return out

    def with_processor(self, processor: dict[str, Any]) -> VisionConfig:
        return replace(self, processor_json=json.dumps(processor, sort_keys=True))


def vision_config_from_hf(cfg: dict[str, Any]) -> VisionConfig | None:
    """The VisionConfig of a top-level HF config.json dictionary; None for a text-only model.
    A vision-language type servelm does not run is a ValueError naming it."""
    if not isinstance(cfg.get("vision_config"), dict):
        return None
    model_type = cfg.get("model_type", "")
    if model_type not in VISION_FAMILIES:
        raise ValueError(f"vision-language model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(sorted(VISION_FAMILIES))})")
    family, prompt = VISION_FAMILIES[model_type]
    token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if token is None:
        raise ValueError(f"config.json of a {model_type} model has no 'image_token_id'")
    encoder = dict(cfg["vision_config"])
    # LLaVA's connector reads these from the top level
    for key in ("projector_hidden_act", "vision_feature_layer",
                "vision_feature_select_strategy", "multimodal_projector_bias"):
        if key in cfg:
            encoder[f"_{key}"] = cfg[key]
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    rope = text.get("rope_parameters") or text.get("rope_scaling") or cfg.get("rope_scaling")
    section = tuple(int(x) for x in (rope or {}).get("mrope_section") or ())
    return VisionConfig(family, int(token), prompt, json.dumps(encoder, sort_keys=True),
                        mrope_section=section)


__all__ = ["VISION_FAMILIES", "VisionConfig", "vision_config_from_hf"]
