"""Built-in model architectures, stored as the fields of their HF config.json.

Owns: the catalog (name -> config dict + the URL it was copied from) and `resolve_model`,
which turns a `--model` value (catalog name, HF repo id, config.json path, directory or
.gguf file) into a ModelConfig, read by ModelConfig's own HF and GGUF readers, with their
errors as PlanInputError naming --model.
Never: stores parameter counts; those are computed from the shapes (servelm.cost); imports
`gguf` unless a .gguf file is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servelm.config import ModelConfig
from servelm.planner.errors import PlanInputError

_HF = "https://huggingface.co/{}/blob/main/config.json"

_LLAMA31 = {"model_type": "llama", "vocab_size": 128256, "max_position_embeddings": 131072,
            "tie_word_embeddings": False, "num_key_value_heads": 8}

# name -> (HF repo whose config.json these fields were copied from, the fields)
_CATALOG: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama-3.1-8B": ("meta-llama/Llama-3.1-8B", {**_LLAMA31, "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32}),
    "Llama-3.1-70B": ("meta-llama/Llama-3.1-70B", {**_LLAMA31, "hidden_size": 8192,
        "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80}),
    "Llama-3.1-405B": ("meta-llama/Llama-3.1-405B", {**_LLAMA31, "hidden_size": 16384,
        "intermediate_size": 53248, "num_attention_heads": 128, "num_hidden_layers": 126}),
    "Llama-2-7B": ("meta-llama/Llama-2-7b-hf", {"model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
        "num_hidden_layers": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
        "tie_word_embeddings": False}),
    "Qwen2.5-7B": ("Qwen/Qwen2.5-7B", {"model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
        "num_hidden_layers": 28, "vocab_size": 152064, "max_position_embeddings": 131072,
        "tie_word_embeddings": False}),
    "Qwen3-0.6B": ("Qwen/Qwen3-0.6B", {"model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "num_hidden_layers": 28, "vocab_size": 151936,
        "max_position_embeddings": 40960, "tie_word_embeddings": True,
        "attention_bias": False}),
    "Qwen3-30B-A3B": ("Qwen/Qwen3-30B-A3B", {"model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_hidden_layers": 48, "vocab_size": 151936,
        "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "attention_bias": False}),
    "Mixtral-8x7B": ("mistralai/Mixtral-8x7B-v0.1", {"model_type": "mixtral",
        "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000,
        "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
        "tie_word_embeddings": False}),
    "DeepSeek-V3": ("deepseek-ai/DeepSeek-V3", {"model_type": "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "vocab_size": 129280, "max_position_embeddings": 163840,
        "tie_word_embeddings": False}),
    "SmolLM2-135M": ("HuggingFaceTB/SmolLM2-135M", {"model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "num_hidden_layers": 30, "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": True}),
}


def catalog_names() -> list[str]:
    return list(_CATALOG)


def from_hf_config(cfg: dict[str, Any], name: str = "", source: str = "") -> ModelConfig:
    """ModelConfig.from_hf_config, its errors naming the planner's --model flag."""
    try:
        return ModelConfig.from_hf_config(cfg, name=name, source=source)
    except ValueError as e:
        raise PlanInputError("--model", str(e)) from e


def load_hf_config(path: str | Path) -> ModelConfig:
    """A config.json file, or a directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanInputError("--model", f"cannot read {p}: {e}") from e
    return from_hf_config(cfg, name=p.parent.name if p.name == "config.json" else p.stem,
                          source=str(p))


def load_gguf(path: str | Path) -> ModelConfig:
    """A .gguf file's metadata (no tensor data is read)."""
    p = Path(path)
    try:
        from gguf import GGUFReader  # lazy: optional for the planner
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise PlanInputError("--model", "reading GGUF needs the `gguf` package") from e
    try:
        reader = GGUFReader(str(p))
    except (OSError, ValueError) as e:
        raise PlanInputError("--model", f"cannot read GGUF {p}: {e}") from e
    meta = {name: field.contents() for name, field in reader.fields.items()}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    try:
        return ModelConfig.from_gguf_metadata(meta.get, types, name=str(meta.get(
            "general.name") or p.stem), source=str(p))
    except (TypeError, ValueError) as e:
        raise PlanInputError("--model", f"GGUF {p}: missing or bad metadata: {e}") from e


def builtin_model(name: str) -> ModelConfig:
    """Catalog lookup, case-insensitive; an HF repo id ("meta-llama/Llama-3.1-8B") works too."""
    wanted = name.lower()
    for key, (repo, cfg) in _CATALOG.items():
        if wanted in (key.lower(), repo.lower(), repo.split("/")[1].lower()):
            return from_hf_config(cfg, name=key, source=_HF.format(repo))
    raise PlanInputError(
        "--model", f"unknown model {name!r}; built-ins: {', '.join(_CATALOG)}, "
        "or a path to a config.json, a model directory or a .gguf file")


def resolve_model(value: str) -> ModelConfig:
    p = Path(value)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise PlanInputError("--model", f"no such GGUF file: {value}")
        return load_gguf(p)
    if p.suffix == ".json" or p.is_dir():
        return load_hf_config(p)
    return builtin_model(value)
