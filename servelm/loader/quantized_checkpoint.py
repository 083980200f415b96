"""Pre-quantized checkpoints: the directory `servelm quantize` writes and `build_engine` loads
as it is.

Owns: the directory layout and its metadata, and reading it:

    DIR/config.json          the HF config, plus "quantization_config" (the method: read at
                             load time, never guessed from a file name)
    DIR/model.safetensors    per HF linear `X.weight`:  X.qweight  int8 [out, in] (int8) or
                             uint8 [out, in/2] (int4, two codes a byte, quantized_weight.py)
                                                        X.scales   [out] | [out, G]
                                                        X.zeros    [out, G] (int4 only)
                             everything else (embedding, norms, biases, layers a method keeps
                             float) under its HF name, in the narrowest float dtype that holds
                             its values exactly; the header's metadata (HEADER_KEY) names each
                             linear's format ("int8", "int4-g32", ...) and the method again
    DIR/tokenizer.json, tokenizer_config.json (+ generation_config.json, chat_template.jinja
                             when the source has them)

A tied lm_head is written as its own int8 `lm_head` (the copy the engine would make at load
time) and config.json says `tie_word_embeddings: false`: the float embedding stays for the
lookup, and loading builds the head from its codes instead of requantizing.

Loading yields (HF name, QuantizedWeight) pairs that the model hands to its StagedLinears,
which the method builds (`QuantMethod.build`) without a float round trip; quantizing at load
time is `build(quantize(w))` with the same `quantize` the writer called, so the two engines
are the same.

Never: guesses a method (the metadata names it), loads a checkpoint under another method
(`--quantization` that disagrees with the metadata is an error naming `quantization`), or
writes one (the writer builds a model to quantize it, above the loader:
servelm/quant_tools/quantize.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servelm.protocol import InvalidParameterError

if TYPE_CHECKING:
    from servelm.config import ModelConfig
    from servelm.loader.community_checkpoint import CommunityCheckpoint

QUANT_METHOD_TAG = "servelm"  # quantization_config.quant_method: transformers refuses it
WEIGHTS_FILE = "model.safetensors"
HEADER_KEY = "servelm_quantization"  # model.safetensors' metadata: method and formats


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A directory written by `servelm quantize`, as its config.json describes it."""

    path: Path
    method: str
    config: dict[str, Any] = field(hash=False, compare=False)  # quantization_config

    def method_for(self, requested: str | None) -> str:
        """The method to load with: the checkpoint's; `requested` may only repeat it."""
        if requested is not None and requested != self.method:
            raise InvalidParameterError(
                f"quantization {requested!r} was given, but {self.path} is a checkpoint "
                f"pre-quantized with {self.method!r} (its config.json quantization_config); "
                f"omit --quantization or pass {self.method!r}", param="quantization")
        return self.method

    def iter_weights(self, config: ModelConfig) -> Iterator[tuple[str, Any]]:
        return iter_quantized_weights(self, config)


def read_quantized_checkpoint(path: Path) -> QuantizedCheckpoint | CommunityCheckpoint | None:
    """The checkpoint's quantization, or None for a float HF directory (or a GGUF file).

    A block-quantized fp8 checkpoint (DeepSeek's layout) is read as a float one: the loader
    dequantizes it (servelm/loader/fp8_blocks.py). GPTQ, AWQ and compressed-tensors
    checkpoints keep their codes (servelm/loader/community_checkpoint.py); a
    quantization_config from another tool (bitsandbytes, per-tensor fp8, ...) is an error
    naming it and why.
    """
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return None
    hf = json.loads(config_path.read_text(encoding="utf-8"))
    qc = hf.get("quantization_config")
    legacy = Path(path) / "quantize_config.json"  # AutoGPTQ's, beside a plain config.json
    if qc is None and legacy.is_file():
        qc = {"quant_method": "gptq", **json.loads(legacy.read_text(encoding="utf-8"))}
        hf = {**hf, "quantization_config": qc}
    if qc is None:
        return None
    tag = qc.get("quant_method") if isinstance(qc, dict) else None
    if tag == "fp8" and "weight_block_size" in qc:
        from servelm.loader.fp8_blocks import fp8_block_size

        fp8_block_size(Path(path))  # a malformed block layout is refused here, by field
        return None
    if tag != QUANT_METHOD_TAG:
        from servelm.loader.community_checkpoint import read_community_checkpoint

        return read_community_checkpoint(Path(path), hf)  # or refused, naming why
    from servelm.quant import quant_method_names

    method = qc.get("method")
    if method not in quant_method_names():
        raise InvalidParameterError(
            f"{path}: quantization_config.method {method!r} is not a servelm method "
            f"({quant_method_names()}); was it written by a newer servelm?", param="model")
    return QuantizedCheckpoint(Path(path), method, qc)


# -- reading -------------------------------------------------------------------------------


def iter_quantized_weights(checkpoint: QuantizedCheckpoint,
                           config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 tensor or QuantizedWeight) for every weight the model needs."""
    import torch
    from safetensors import safe_open

    from servelm.loader.hf_loader import hf_weight_names
    from servelm.quant.quantized_weight import QuantizedWeight, unpack_int4

    path = checkpoint.path / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint.path} has no {WEIGHTS_FILE}")
    wanted = set(hf_weight_names(config))
    seen: set[str] = set()
    with safe_open(str(path), framework="pt", device="cpu") as f:
        header = json.loads((f.metadata() or {}).get(HEADER_KEY, "{}"))
        if header.get("method") != checkpoint.method:
            raise ValueError(f"{path}: its header says method {header.get('method')!r}, "
                             f"config.json says {checkpoint.method!r}; the files do not belong "
                             "together")
        formats: dict[str, str] = header.get("formats", {})
        keys = set(f.keys())
        for name in sorted(keys):
            if name.endswith((".scales", ".zeros")):
                continue
            if name.endswith(".qweight"):
                base = name.removesuffix(".qweight")
                kind = formats.get(base)
                if kind is None:
                    raise ValueError(f"{path}: no format recorded for {base}")
                q = f.get_tensor(name)
                scale = f.get_tensor(f"{base}.scales")
                if kind == "int8" or kind.startswith("int8-g"):
                    group = int(kind.removeprefix("int8-g")) if kind != "int8" else 0
                    weight = QuantizedWeight("int8", q, scale, None, group)
                else:
                    group = int(kind.removeprefix("int4-g"))
                    weight = QuantizedWeight("int4", unpack_int4(q), scale,
                                             f.get_tensor(f"{base}.zeros"), group)
                out_name, value = f"{base}.weight", weight.validate()
            else:
                out_name, value = name, f.get_tensor(name).to(torch.float32)
            if out_name in wanted:
                seen.add(out_name)
                yield out_name, value
    missing = wanted - seen
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} weights the config needs, e.g. "
                         f"{sorted(missing)[:3]}")
