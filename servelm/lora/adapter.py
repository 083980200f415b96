"""Reading and checking a PEFT LoRA adapter directory, without torch.

Owns: `read_adapter(path, model_config, max_rank) -> AdapterSpec`: adapter_config.json parsed
and every field servelm does not implement refused by name, the safetensors header of
adapter_model.safetensors parsed (never the tensor data), each tensor mapped onto the
projection of servelm's model it changes (PEFT's q/k/v_proj onto slices of the fused
qkv_proj, gate/up_proj onto slices of gate_up_proj) and its shape checked against the base
model. The engine calls it when an adapter is registered, so a bad adapter is refused
before any request can use it.
Never: imports torch, or reads the weights (the runner does, servelm/lora/weights.py).

    PEFT tensor name                                          servelm target (layer, linear, slice)
    base_model.model.model.layers.3.self_attn.k_proj.lora_A   (3, "qkv_proj", 1)   A: [r, hidden]
    base_model.model.model.layers.3.self_attn.k_proj.lora_B   (3, "qkv_proj", 1)   B: [kv_size, r]
    base_model.model.model.layers.3.mlp.up_proj.lora_B        (3, "gate_up_proj", 1)
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

from servelm.models.packed import PACKED_MODULES, part_rows, parts_of
from servelm.protocol import InvalidParameterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_HEADER_BYTES = 64 * 2**20

# The dense layers LoRA adapts (check_model_supports_lora refuses the others) pack q/k/v and
# gate/up as the model's table says; the runner's LoraManager checks the served model's.
PACKED = {k: PACKED_MODULES[k] for k in ("qkv_proj", "gate_up_proj")}
# The projections not packed: (in_features, out_features) as ModelConfig fields
_UNPACKED = {"o_proj": ("q_size", "hidden_size"), "down_proj": ("intermediate_size", "hidden_size")}
# PEFT module name -> (servelm linear, slice of it)
TARGETS = {**{part: tuple(at) for part, at in parts_of(PACKED).items()},
           **{name: (name, 0) for name in _UNPACKED}}
LINEAR_PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
                 "down_proj": "mlp"}
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_NAME = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\."
                   r"(?:self_attn|mlp)\.(\w+?)\.lora_([AB])(?:\.default)?\.weight")
# Config fields of LoRA variants servelm does not implement: refused unless at their default.
_REFUSED_FIELDS = {
    "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {},
    "alpha_pattern": {}, "megatron_config": None, "trainable_token_indices": None,
    "alora_invocation_tokens": None, "use_qalora": False, "layer_replication": None,
    "lora_bias": False, "target_parameters": None, "use_bdlora": None, "arrow_config": None,
    "kasa_config": None, "velora_config": None, "monteclora_config": None,
}


class LoraAdapterError(InvalidParameterError):
    """An adapter servelm cannot serve; `param` names the field (or file) at fault."""

    def __init__(self, message: str, param: str = "lora_path"):
        super().__init__(message, param=param, code="invalid_lora_adapter")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # into the data section of the safetensors file


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter that passed every check: where it is and what it changes."""

    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    # (layer, servelm linear, slice) -> (A tensor name, B tensor name)
    targets: dict[tuple[int, str, int], tuple[str, str]]
    tensors: dict[str, TensorInfo]

    @property
    def num_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors.values())

    @property
    def target_modules(self) -> list[str]:
        back = {v: k for k, v in TARGETS.items()}
        return sorted({back[(lin, s)] for _, lin, s in self.targets})


def target_shapes(model_config) -> dict[tuple[str, int], tuple[int, int]]:
    """(servelm linear, slice) -> (in_features, out_features of the slice) for the dense
    layers of servelm's one decoder frame (models/decoder.py)."""
    c = model_config
    shapes = {(packed, j): (c.hidden_size, rows) for packed in PACKED
              for j, rows in enumerate(part_rows(c, PACKED, packed))}
    for name, (n_in, n_out) in _UNPACKED.items():
        shapes[(name, 0)] = (getattr(c, n_in), getattr(c, n_out))
    return shapes


def check_model_supports_lora(model_config) -> None:
    """LoRA needs the dense GQA layers whose projections target_shapes describes."""
    if getattr(model_config, "is_mla", False) or model_config.kv_lora_rank:
        raise InvalidParameterError("LoRA adapters are not supported on MLA attention models "
                                    f"({model_config.architecture})", param="enable_lora")
    if model_config.num_experts:
        raise InvalidParameterError("LoRA adapters are not supported on mixture-of-experts "
                                    f"models ({model_config.architecture})", param="enable_lora")
    if getattr(model_config, "vision", None) is not None:
        raise InvalidParameterError("LoRA adapters are not supported on vision-language models "
                                    f"({model_config.architecture})", param="enable_lora")


def read_adapter(path: str, model_config, max_rank: int) -> AdapterSpec:
    """Parse and check the adapter at `path` against the base model; LoraAdapterError names
    the first field (or file) that servelm cannot serve."""
    if not os.path.isdir(path):
        raise LoraAdapterError(f"lora_path {path!r} is not a directory")
    cfg = _read_config(path)
    rank, scaling = _check_config(cfg, max_rank)
    tensors = _read_header(os.path.join(path, WEIGHTS_FILE))
    targets = _map_tensors(tensors, model_config, rank)
    return AdapterSpec(os.path.abspath(path), rank, scaling, targets, tensors)


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoraAdapterError(f"{file} not found (a PEFT adapter directory holds "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"{file} is not valid JSON: {exc}", CONFIG_FILE) from None
    if not isinstance(cfg, dict):
        raise LoraAdapterError(f"{file} must hold a JSON object", CONFIG_FILE)
    return cfg


def _check_config(cfg: dict, max_rank: int) -> tuple[int, float]:
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoraAdapterError(f"peft_type {peft_type!r} is not supported (LORA only)",
                               "peft_type")
    for name, default in _REFUSED_FIELDS.items():
        value = cfg.get(name, default)
        if value not in (default, None) and not (value == [] or value == {}):
            raise LoraAdapterError(f"{name}={value!r} is not supported (servelm serves plain "
                                   f"LoRA: {name} must be {default!r})", name)
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise LoraAdapterError(f"bias={bias!r} is not supported (bias must be 'none')", "bias")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"r must be a positive integer, got {rank!r}", "r")
    if rank > max_rank:
        raise LoraAdapterError(f"r={rank} exceeds --max-lora-rank {max_rank}", "r")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraAdapterError(f"lora_alpha must be a number, got {alpha!r}", "lora_alpha")
    targets = cfg.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for t in names:
        if t in ("embed_tokens", "lm_head", "wte", "word_embeddings"):
            raise LoraAdapterError(f"target_modules {t!r}: embedding and output-head adapters "
                                   "are not supported", "target_modules")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_header(file: str) -> dict[str, TensorInfo]:
    """The tensor table of a safetensors file; every entry checked against the file size."""
    if not os.path.exists(file):
        bin_file = os.path.join(os.path.dirname(file), "adapter_model.bin")
        hint = " (adapter_model.bin is not read: save with safe_serialization)" \
            if os.path.exists(bin_file) else ""
        raise LoraAdapterError(f"{file} not found{hint}", WEIGHTS_FILE)
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise ValueError(f"header length {n} does not fit the {size}-byte file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        data_bytes = size - 8 - n
        out = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), \
                entry["data_offsets"]
            if dtype not in _DTYPE_BYTES:
                raise ValueError(f"tensor {name!r} has dtype {dtype} (F32, F16 or BF16 only)")
            if end - start != math.prod(shape) * _DTYPE_BYTES[dtype] or not \
                    0 <= start <= end <= data_bytes:
                raise ValueError(f"tensor {name!r} lies outside the file's data "
                                 f"({start}..{end} of {data_bytes} bytes)")
            out[name] = TensorInfo(dtype, shape, (start, end))
    except OSError as exc:
        raise LoraAdapterError(f"{file} cannot be read: {exc}", WEIGHTS_FILE) from None
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise LoraAdapterError(f"{file} is not a valid safetensors file: {exc}",
                               WEIGHTS_FILE) from None
    return out


def _map_tensors(tensors: dict[str, TensorInfo], model_config, rank: int
                 ) -> dict[tuple[int, str, int], tuple[str, str]]:
    shapes = target_shapes(model_config)
    found: dict[tuple[int, str, int], dict[str, str]] = {}
    for name, info in tensors.items():
        if "lora_magnitude_vector" in name:
            raise LoraAdapterError(f"tensor {name!r}: DoRA is not supported", "use_dora")
        if "lora_embedding" in name:
            raise LoraAdapterError(f"tensor {name!r}: embedding adapters are not supported",
                                   "target_modules")
        m = _NAME.fullmatch(name)
        if m is None:
            raise LoraAdapterError(f"tensor {name!r} is not a LoRA A/B matrix of a decoder "
                                   "layer projection servelm can adapt", "target_modules")
        layer, module, ab = int(m[1]), m[2], m[3]
        if module not in TARGETS:
            raise LoraAdapterError(
                f"target module {module!r} (tensor {name!r}) is not one this model has; "
                f"supported: {', '.join(TARGETS)}", "target_modules")
        if layer >= model_config.num_layers:
            raise LoraAdapterError(f"tensor {name!r}: layer {layer} is beyond the base "
                                   f"model's {model_config.num_layers} layers", "target_modules")
        linear, slice_ = TARGETS[module]
        n_in, n_out = shapes[(linear, slice_)]
        want = (rank, n_in) if ab == "A" else (n_out, rank)
        if info.shape != want:
            raise LoraAdapterError(
                f"tensor {name!r} has shape {list(info.shape)}, the base model needs "
                f"{list(want)} (r={rank}); is the adapter for another base model?", "lora_path")
        found.setdefault((layer, linear, slice_), {})[ab] = name
    if not found:
        raise LoraAdapterError(f"{WEIGHTS_FILE} holds no LoRA tensors", "target_modules")
    targets = {}
    for key, pair in found.items():
        if set(pair) != {"A", "B"}:
            have = next(iter(pair.values()))
            raise LoraAdapterError(f"tensor {have!r} has no lora_{'B' if 'A' in pair else 'A'} "
                                   "partner", WEIGHTS_FILE)
        targets[key] = (pair["A"], pair["B"])
    return targets


__all__ = ["AdapterSpec", "LoraAdapterError", "TARGETS", "check_model_supports_lora",
           "read_adapter", "target_shapes"]
