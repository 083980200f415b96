"""Model families, registered by name (ModelConfig.architecture) and imported when chosen."""

from __future__ import annotations

import importlib

_MODELS = {
    "llama": "servelm.models.llama:LlamaForCausalLM",
    "qwen2": "servelm.models.llama:Qwen2ForCausalLM",
    "qwen3": "servelm.models.llama:Qwen3ForCausalLM",
    "mixtral": "servelm.models.mixtral:MixtralForCausalLM",
    "qwen2_moe": "servelm.models.qwen_moe:Qwen2MoeForCausalLM",
    "qwen3_moe": "servelm.models.qwen_moe:Qwen3MoeForCausalLM",
    "gemma2": "servelm.models.gemma:Gemma2ForCausalLM",
    "gemma3_text": "servelm.models.gemma:Gemma3ForCausalLM",
    "phi3": "servelm.models.phi3:Phi3ForCausalLM",
    "deepseek_v2": "servelm.models.deepseek:DeepseekV2ForCausalLM",
    "deepseek_v3": "servelm.models.deepseek:DeepseekV3ForCausalLM",
    "qwen2_vl": "servelm.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "llava": "servelm.models.llava:LlavaForConditionalGeneration",
}


def get_model_class(architecture: str):
    try:
        module, cls = _MODELS[architecture].split(":")
    except KeyError:
        # ModelConfig reads MoE/MLA and other families too (the planner and the cost model
        # use their shapes); the engine refuses them here, before any weight is read.
        raise ValueError(f"architecture {architecture!r} is not supported by the engine; "
                         f"supported: {sorted(_MODELS)} (`servelm plan` still plans it)"
                         ) from None
    return getattr(importlib.import_module(module), cls)
