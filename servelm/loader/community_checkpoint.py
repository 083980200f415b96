"""Quantized safetensors checkpoints made by other tools: which ones load, and how.

Owns: reading `quantization_config.quant_method` from config.json, refusing by name (with the
reason) the methods servelm does not load, and streaming a GPTQ, AWQ or compressed-tensors
checkpoint as (HF name, float32 tensor or QuantizedWeight) pairs, the same stream a
`servelm quantize` checkpoint gives, so the model's StagedLinears (and MoE experts) build the
layers from the codes once, at load, with no float round trip:

    quant_method          module                          layers
    gptq                  servelm/quant/gptq.py           int4 / int8 (act-order: + a perm)
    awq                   servelm/quant/awq.py            int4
    compressed-tensors    servelm/quant/compressed_tensors.py   int4 / int8

The layers are built by the method of the same name (servelm/quant/codes_method.py). A
family whose model refuses that method (models/decoder.py lists the methods its MoE and
decoder families take) gets the registered int8 / int4-gN method that takes the same codes;
that one also quantizes the lm_head to int8 and float-stored linears by RTN.

Never: guesses a format from tensor names (the config names it) or loads the pickled
`*.bin` weights of older GPTQ releases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servelm.protocol import InvalidParameterError

if TYPE_CHECKING:
    from servelm.config import ModelConfig

# quant_method -> (module, registered method name)
LOADED = {"gptq": ("servelm.quant.gptq", "gptq"), "awq": ("servelm.quant.awq", "awq"),
          "compressed-tensors": ("servelm.quant.compressed_tensors", "compressed-tensors")}
METHODS = tuple(name for _, name in LOADED.values())
REFUSED = {
    "bitsandbytes": "bitsandbytes' NF4 / FP4 / LLM.int8 codes have no servelm kernel (its "
                    "int8 keeps outliers in float16 beside the codes); serve the float "
                    "checkpoint with --quantization int8 or int4",
    "hqq": "HQQ's per-group float zero points and its bit layouts have no servelm kernel",
    "eetq": "EETQ's int8 layout is its CUDA kernel's own",
    "aqlm": "AQLM's additive codebooks have no servelm kernel",
    "quanto": "optimum-quanto's layouts have no servelm kernel",
    "exl2": "ExLlamaV2's mixed-bit codes have no servelm kernel",
    "gptq_marlin": "a Marlin repack of GPTQ codes; load the plain GPTQ checkpoint",
    "awq_marlin": "a Marlin repack of AWQ codes; load the plain AWQ checkpoint",
    "marlin": "Marlin's layout is its CUDA kernel's own",
    "torchao": "torchao's tensor subclasses are pickled objects, not codes servelm reads",
    "fbgemm_fp8": "per-channel fp8 with FBGEMM's activation bounds; servelm reads block-"
                  "quantized fp8 only",
    "mxfp4": "MXFP4 (4-bit floats with shared exponents) has no servelm kernel",
    "bitnet": "ternary BitNet weights have no servelm kernel",
    "vptq": "vector-quantized codebooks have no servelm kernel",
    "higgs": "HIGGS' lattice codebooks have no servelm kernel",
    "spqr": "SpQR's sparse outliers have no servelm kernel",
    "fp_quant": "FP-Quant's rotated 4-bit floats have no servelm kernel",
}


def refused_reason(tag: str) -> str:
    return REFUSED.get(str(tag).lower(), "servelm reads GPTQ, AWQ, compressed-tensors, "
                       "block-quantized fp8 and its own `servelm quantize` checkpoints")


@dataclass(frozen=True)
class CommunityCheckpoint:
    """A GPTQ, AWQ or compressed-tensors directory, as its config.json describes it."""

    path: Path
    method: str  # the registered method of its layers (see the module docstring)
    spec: Any  # the format module's parsed config
    hf_config: dict[str, Any] = field(hash=False, compare=False)

    @property
    def quant_method(self) -> str:
        return self.hf_config["quantization_config"]["quant_method"]

    def method_for(self, requested: str | None) -> str:
        """The method to load with; `requested` may only name the checkpoint's own."""
        if requested is not None and requested != self.method:
            raise InvalidParameterError(
                f"quantization {requested!r} was given, but {self.path} is a "
                f"{self.quant_method} checkpoint (its config.json quantization_config); omit "
                f"--quantization or pass {self.method!r}", param="quantization")
        return family_method(self)

    def iter_weights(self, config: ModelConfig) -> Iterator[tuple[str, Any]]:
        return iter_community_weights(self, config)


def read_community_checkpoint(path: Path, hf: dict[str, Any]) -> CommunityCheckpoint:
    """The checkpoint of config.json `hf`, or InvalidParameterError (param "model") naming
    the method or field servelm does not load, with the reason."""
    import importlib

    qc = hf["quantization_config"]
    tag = str(qc.get("quant_method", "")).lower()
    if tag not in LOADED:
        raise InvalidParameterError(
            f"{path} is quantized with {qc.get('quant_method')!r} (config.json "
            f"quantization_config), which servelm does not load: {refused_reason(tag)}",
            param="model")
    module, method = LOADED[tag]
    spec = importlib.import_module(module).parse_config(qc, str(path))
    return CommunityCheckpoint(Path(path), method, spec, hf)


def family_method(checkpoint: CommunityCheckpoint) -> str:
    """The checkpoint's own method, or, for a family whose model does not take it yet, the
    registered int8 / int4-gN method of its codes (see the module docstring)."""
    from servelm.config import ModelConfig
    from servelm.models import get_model_class

    arch = ModelConfig.from_hf_config(checkpoint.hf_config).architecture
    cls = get_model_class(arch)
    if _family_takes(cls, checkpoint.method):
        return checkpoint.method
    fallback = _registered_equivalent(checkpoint)
    if fallback is None or not _family_takes(cls, fallback):
        raise InvalidParameterError(
            f"{checkpoint.path}: the {arch} family does not load {checkpoint.quant_method} "
            "checkpoints (its model takes no method that holds these codes)", param="model")
    return fallback


def _family_takes(cls, method: str) -> bool:
    """Whether the model class takes quantization `method` (models/decoder.py)."""
    from servelm.models import decoder

    if hasattr(cls, "quant_methods"):  # None: every method
        return cls.quant_methods is None or method in cls.quant_methods
    if not issubclass(cls, decoder.DecoderLM):  # the frame before quant_methods: Llama's
        return True
    return bool(getattr(cls, "quantizable", False)) and method in getattr(
        decoder, "_EXPERT_METHODS", ())


def _registered_equivalent(checkpoint: CommunityCheckpoint) -> str | None:
    """int8 or int4-gN: the registered method whose layers take this checkpoint's codes."""
    qc = checkpoint.hf_config["quantization_config"]
    if checkpoint.method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        bits = {w.get("num_bits") for w in weights}
        sizes = set(checkpoint.spec.group_sizes)
    else:
        bits = {qc.get("bits", 4)}
        sizes = {max(int(checkpoint.spec.group_size), 0)}
    if len(bits) != 1 or len(sizes) != 1:
        return None
    (bit,), (size,) = bits, sizes
    if bit == 8:
        return "int8" if size == 0 else None
    from servelm.quant.community_codes import fit_group_size

    group = 128 if size == 0 else fit_group_size(size, size + 1, "group_size")[0]
    return f"int4-g{group}"


# -- reading -------------------------------------------------------------------------------


def _module_of(checkpoint: CommunityCheckpoint):
    import importlib

    return importlib.import_module(LOADED[checkpoint.quant_method.lower()][0])


def iter_community_weights(checkpoint: CommunityCheckpoint,
                           config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 tensor or QuantizedWeight) for every weight of the checkpoint; for
    the Llama-named families only those the config needs (missing ones named)."""
    from safetensors import safe_open

    from servelm.loader.hf_loader import _LLAMA_NAMED, hf_weight_names

    files = sorted(checkpoint.path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{checkpoint.path} has no *.safetensors (pickled *.bin "
                                "checkpoints are never loaded)")
    fmt = _module_of(checkpoint)
    # act-order codes keep a perm only for the checkpoint's own method (codes_method.py)
    spec = checkpoint.spec._replace(keep_act_order=family_method(checkpoint)
                                    == checkpoint.method)
    checkpoint = dataclasses.replace(checkpoint, spec=spec)
    wanted = set(hf_weight_names(config)) if config.architecture in _LLAMA_NAMED else None
    seen: set[str] = set()
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                   for f in files]
        where = {name: h for h in handles for name in h.keys()}
        for name, value in _tensors(checkpoint, fmt, where):
            if wanted is None or name in wanted:
                seen.add(name)
                yield name, value
    missing = set() if wanted is None else wanted - seen
    if missing:
        raise ValueError(f"{checkpoint.path} lacks {len(missing)} weights the config needs, "
                         f"e.g. {sorted(missing)[:3]}")


def _tensors(checkpoint: CommunityCheckpoint, fmt, where: dict) -> Iterator[tuple[str, Any]]:
    import torch

    quantized = {n.rpartition(".")[0] for n in where if n.rpartition(".")[2] == fmt.MARKER}
    skipped = getattr(fmt, "SKIPPED", ())
    for name in sorted(where):
        prefix, _, suffix = name.rpartition(".")
        if suffix in skipped:
            continue
        if prefix in quantized and suffix in fmt.SUFFIXES:
            if suffix != fmt.MARKER:
                continue  # read with the module's marker tensor

            def get(s, p=prefix):
                full = f"{p}.{s}"
                return where[full].get_tensor(full) if full in where else None

            yield f"{prefix}.weight", fmt.read_linear(checkpoint.spec, get, prefix)
            continue
        tensor = where[name].get_tensor(name)
        if (prefix in quantized and suffix == "bias" and not tensor.any()
                and not checkpoint_has_bias(checkpoint, prefix)):
            continue  # AutoGPTQ saved zero biases for bias-free layers
        yield name, tensor.to(torch.float32)


def checkpoint_has_bias(checkpoint: CommunityCheckpoint, prefix: str) -> bool:
    """Whether the architecture gives this linear a bias (q/k/v with attention_bias or a
    Qwen2-style model), so that a zero bias is a real one."""
    hf = checkpoint.hf_config
    leaf = prefix.rpartition(".")[2]
    if leaf in ("q_proj", "k_proj", "v_proj"):
        return bool(hf.get("attention_bias")) or hf.get("model_type") in ("qwen2",
                                                                          "qwen2_moe")
    return bool(hf.get("mlp_bias"))
