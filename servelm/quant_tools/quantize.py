"""`quantize_checkpoint`: a model's linear layers quantized with a method and written as a
servelm pre-quantized checkpoint (the layout: servelm/loader/quantized_checkpoint.py, which
reads it back).

Owns: building the model with its weights staged (not yet quantized), taking each linear's
codes from the same `quantize` the engine would call at load time, splitting fused layers
back into their HF tensors, and writing the directory (tensors, config.json with its
quantization_config, the tokenizer).

Never: imported by production code (it builds a model and reads checkpoints: above the
models and the loader), or writes over a non-empty directory unasked.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servelm.loader.quantized_checkpoint import (HEADER_KEY, QUANT_METHOD_TAG, WEIGHTS_FILE,
                                                 read_quantized_checkpoint)
from servelm.models.packed import part_offsets
from servelm.protocol import InvalidParameterError

if TYPE_CHECKING:
    import torch

    from servelm.config import ModelConfig

# family -> (HF model_type, architectures entry)
_FAMILY_HF = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
              "qwen3": ("qwen3", "Qwen3ForCausalLM")}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class QuantizeSummary:
    out_dir: Path
    method: str
    num_bytes: int  # of model.safetensors
    formats: dict[str, int]  # format -> number of linear tensors
    seconds: float


def quantize_checkpoint(model: str, method: str, out_dir: str | Path,
                        overwrite: bool = False) -> QuantizeSummary:
    """Quantize `model` (registry name, GGUF file or HF directory) with `method` into out_dir."""
    start = time.monotonic()
    from servelm.loader import load_model_config, load_tokenizer, resolve_model
    from servelm.quant import get_quant_method, quant_method_names

    if method not in quant_method_names():
        raise InvalidParameterError(f"method {method!r} is not supported; supported: "
                                    f"{quant_method_names()}", param="method")
    quant = get_quant_method(method)
    source = resolve_model(model)
    if source.kind == "dummy":
        raise InvalidParameterError(f"{model!r} is a random-weight dummy model; quantize a "
                                    "real checkpoint", param="model")
    if source.kind == "hf" and read_quantized_checkpoint(source.path) is not None:
        raise InvalidParameterError(f"{model!r} is already a quantized checkpoint; quantize "
                                    "its float source instead", param="model")
    if method == "gguf" and source.kind != "gguf":
        raise InvalidParameterError(f"method 'gguf' keeps a GGUF file's blocks; {model!r} is "
                                    f"a {source.kind} model (use int8 or int4)", param="method")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InvalidParameterError(f"{out} exists and is not empty (pass --overwrite)",
                                    param="out")
    config = load_model_config(source)
    tokenizer = load_tokenizer(source)
    tensors, formats = _quantized_tensors(source, config, quant)
    out.mkdir(parents=True, exist_ok=True)
    qc = _quantization_config(method, quant, formats, source, config)
    _write_tensors(out / WEIGHTS_FILE, tensors, method, formats)
    _write_config(out, source, config, tokenizer, qc)
    _write_tokenizer(out, source, tokenizer)
    counts: dict[str, int] = {}
    for kind in formats.values():
        counts[kind] = counts.get(kind, 0) + 1
    return QuantizeSummary(out, method, (out / WEIGHTS_FILE).stat().st_size, counts,
                           time.monotonic() - start)


def _staged_model(source, config: ModelConfig, quant):
    """The model with its weights loaded into StagedLinears, not yet quantized."""
    import torch

    from servelm.loader import iter_weights
    from servelm.models import get_model_class

    if quant.name == "gguf":
        from servelm.loader.gguf_loader import iter_gguf_quantized_weights

        weights = iter_gguf_quantized_weights(source.path, config)
    else:
        weights = iter_weights(source, config)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, None, quant=quant)
    model = model.to_empty(device="cpu").to(torch.float32)
    model.load_weights(weights)
    return model


def _quantized_tensors(source, config: ModelConfig, quant
                       ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """HF-named tensors to save, and the format of each quantized linear (by base name)."""
    from servelm.quant.quantized_weight import QuantizedWeight, pack_int4
    from servelm.quant.staged_linear import StagedLinear

    model = _staged_model(source, config, quant)
    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}

    def put(base: str, weight) -> None:
        if not isinstance(weight, QuantizedWeight):
            tensors[f"{base}.weight"] = _narrowest_exact(weight)
            return
        weight.validate()
        formats[base] = weight.type_name
        q = weight.q if weight.format == "int8" else pack_int4(weight.q)
        tensors[f"{base}.qweight"] = q.contiguous().clone()
        tensors[f"{base}.scales"] = weight.scale.contiguous().clone()
        if weight.zero is not None:
            tensors[f"{base}.zeros"] = weight.zero.contiguous().clone()

    staged = {name: m for name, m in model.named_modules() if isinstance(m, StagedLinear)}
    for name, module in staged.items():
        weight = module.quantized_weight()
        for hf_base, start, length in _hf_shards(model, name):
            part = (weight.rows(start, length) if isinstance(weight, QuantizedWeight)
                    else weight[start:start + length])
            put(hf_base, part)
            if module.bias is not None:
                tensors[f"{hf_base}.bias"] = _narrowest_exact(
                    module.bias.data[start:start + length])
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] not in staged:
            tensors[_hf_name(name)] = _narrowest_exact(param.data)
    if model.lm_head is None:  # tied: the head's own codes, as process_weights would make
        head = quant.lm_head_method()
        put("lm_head", head.quantize(model.embed_tokens.weight.data))
    return tensors, formats


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else f"model.{name}"


def _hf_shards(model, module_name: str) -> list[tuple[str, int, int]]:
    """(HF base name, first row, rows) of each checkpoint tensor fused into a module."""
    prefix, _, leaf = module_name.rpartition(".")
    parts = model.packed_modules.get(leaf)  # the model's table (models/packed.py)
    if parts is None:
        return [(_hf_name(module_name), 0, model.get_submodule(module_name).out_features)]
    offsets = part_offsets(model.config, model.packed_modules, leaf)
    return [(_hf_name(f"{prefix}.{p.name}"), start, rows)
            for p, (start, rows) in zip(parts, offsets)]


def _narrowest_exact(t: torch.Tensor) -> torch.Tensor:
    """bf16 or fp16 when the values survive the trip exactly (HF bf16 checkpoints), else fp32."""
    import torch

    t = t.detach().float().contiguous()
    for dtype in (torch.bfloat16, torch.float16):
        narrow = t.to(dtype)
        if torch.equal(narrow.float(), t):
            return narrow.clone()
    return t.clone()


def _quantization_config(method: str, quant, formats: dict[str, str], source,
                         config: ModelConfig) -> dict[str, Any]:
    import servelm

    kinds = sorted(set(formats.values()))
    groups = sorted({int(k.removeprefix("int4-g")) for k in kinds if k.startswith("int4")})
    return {
        "quant_method": QUANT_METHOD_TAG,
        "method": method,
        "formats": kinds,  # per tensor: model.safetensors' header
        "group_size": groups[0] if len(groups) == 1 else None,
        "int4_convention": "w = (q - 8) * scale + zero, q in 0..15",
        "int8_convention": ("w = q * scale, q in -127..127, one scale per output row (int8) "
                            "or per N inputs of a row (int8-gN)"),
        "scale_dtype": str(quant.compute_dtype).removeprefix("torch."),
        "lm_head": "int8" if quant.lm_head_method() is not None else "float",
        "tied_lm_head": config.tie_word_embeddings,
        "servelm_version": servelm.__version__,
        "source": {"model": source.name, "kind": source.kind, "file": source.path.name},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], method: str,
                   formats: dict[str, str]) -> None:
    from safetensors.torch import save_file

    header = json.dumps({"method": method, "formats": formats}, sort_keys=True)
    save_file(tensors, str(path), metadata={"format": "pt", HEADER_KEY: header})


def _write_config(out: Path, source, config: ModelConfig, tokenizer,
                  qc: dict[str, Any]) -> None:
    if source.kind == "hf":  # keep every field the source had
        hf = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
    else:
        hf = hf_config_dict(config, tokenizer)
    hf["tie_word_embeddings"] = False  # the head has its own codes (see module docstring)
    hf["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")


def hf_config_dict(config: ModelConfig, tokenizer=None) -> dict[str, Any]:
    """An HF config.json that `ModelConfig.from_hf_config` reads back as `config`."""
    eos = list(dict.fromkeys([*config.eos_token_ids,
                              *(tokenizer.eos_token_ids if tokenizer is not None else ())]))
    hf = {
        "architectures": [_FAMILY_HF[config.architecture][1]],
        "model_type": _FAMILY_HF[config.architecture][0],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "hidden_act": config.hidden_act,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": "float32",
    }
    return hf


def _write_tokenizer(out: Path, source, tokenizer) -> None:
    if source.kind == "hf":
        for name in _TOKENIZER_FILES:
            if (source.path / name).is_file():
                shutil.copyfile(source.path / name, out / name)
        return
    # GGUF: the tokenizer servelm rebuilt from the file's metadata, saved as HF files.
    tokenizer.backend.save(str(out / "tokenizer.json"))

    def text(token_id):
        return None if token_id is None else tokenizer.backend.id_to_token(token_id)

    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    tok_cfg = {"bos_token": text(tokenizer.bos_token_id), "eos_token": text(eos),
               "chat_template": tokenizer.chat_template,
               "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n",
                                               encoding="utf-8")
