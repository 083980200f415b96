"""Dummy weights: random tensors at a real model's shapes, from its config alone.

Owns: built-in HF config.json dicts for models whose speed we measure without a checkpoint
(`dummy:llama-3.1-8b`, `dummy:qwen3-0.6b`), the shape of every HF-named tensor a ModelConfig
implies, and `dummy_weights`, which yields them one at a time (a tensor is made only when the
loader asks for it and can be freed once copied, so an 8B model never needs twice its memory).
Never: reads files or downloads; the numbers mean nothing (speed measurements only).

Values: matrices uniform with std 0.02, norm weights 1, biases 0, so activations stay finite
through many layers. Each tensor has its own generator seeded from (seed, name): the same seed
gives the same weights whatever the order of loading.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import torch

from servelm.config import ModelConfig
from servelm.loader.hf_loader import hf_weight_names
from servelm.models.packed import packed_modules_for

DUMMY_PREFIX = "dummy:"
WEIGHT_STD = 0.02

_LLAMA_31_8B = {  # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
_QWEN3_06B = {  # https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA_31_8B,
    "qwen3-0.6b": _QWEN3_06B,
}


def is_dummy_name(model: str) -> bool:
    return isinstance(model, str) and model.lower().startswith(DUMMY_PREFIX)


def dummy_model_config(name: str) -> ModelConfig:
    """"dummy:llama-3.1-8b" or "llama-3.1-8b" (case-insensitive) -> its ModelConfig."""
    key = name.lower().removeprefix(DUMMY_PREFIX)
    if key not in DUMMY_CONFIGS:
        raise ValueError(f"model {name!r}: no built-in dummy config; choose from "
                         f"{[DUMMY_PREFIX + k for k in sorted(DUMMY_CONFIGS)]}")
    return ModelConfig.from_hf_config(DUMMY_CONFIGS[key]).replace(name=DUMMY_PREFIX + key)


def hf_weight_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    """Shape of the HF-named tensor `name` (one of hf_weight_names(config))."""
    c = config
    leaf = name.rsplit(".", 2)[-2]  # "model.layers.0.self_attn.q_proj.weight" -> "q_proj"
    is_bias = name.endswith(".bias")
    if leaf in ("embed_tokens", "lm_head"):
        return (c.vocab_size, c.hidden_size)
    if leaf in ("norm", "input_layernorm", "post_attention_layernorm"):
        return (c.hidden_size,)
    if leaf in ("q_norm", "k_norm"):
        return (c.head_dim,)
    # the parts of the model's packed parameters read the layer's input (models/packed.py)
    out_in = {p.name: (getattr(c, p.rows), c.hidden_size)
              for parts in packed_modules_for(c).values() for p in parts}
    out_in.update(o_proj=(c.hidden_size, c.q_size), down_proj=(c.hidden_size, c.intermediate_size))
    if leaf not in out_in:
        raise ValueError(f"no dummy shape for tensor {name!r}")
    return out_in[leaf][:1] if is_bias else out_in[leaf]


def dummy_weights(config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight `config` needs, as iter_weights yields them, made
    lazily. On the "meta" device the tensors carry shapes only (checks without memory)."""
    device = torch.device(device)
    for name in hf_weight_names(config):
        shape = hf_weight_shape(config, name)
        if device.type == "meta":
            yield name, torch.empty(shape, dtype=dtype, device=device)
        elif name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape, dtype=dtype, device=device)
        else:
            yield name, _uniform(shape, _tensor_seed(seed, name), device, dtype)


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62


def _uniform(shape, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    bound = WEIGHT_STD * 3 ** 0.5  # uniform(-a, a) has std a / sqrt(3)
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.uniform_(-bound, bound, generator=gen)
