"""Model loading: from a name or a path to a ModelConfig, weights and a Tokenizer.

Owns: resolving what the user asked to serve (a cached registry name, a .gguf file, a Hugging
Face directory, or a Hugging Face Hub name `ORG/NAME[:TAG][@REVISION]`) into a `ModelSource`,
and dispatching to the GGUF or HF loader.

Never: downloads at load time except for a Hub name, whose files huggingface_hub fetches into
its own cache (hub_cache.py; registry models are fetched only by `servelm models pull`), or
builds the model itself: weights are handed out as (HF name, float32 CPU tensor) pairs for
`models/` to place.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from servelm.config import ModelConfig
from servelm.loader import model_cache
from servelm.loader.model_cache import ModelPullError, cached_path, list_cached, pull
from servelm.loader.tokenizer import Tokenizer
from servelm.protocol import InvalidParameterError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ModelNotFoundError",
    "ModelPullError",
    "ModelSource",
    "Tokenizer",
    "cached_path",
    "iter_weights",
    "list_cached",
    "load_model_config",
    "load_tokenizer",
    "model_vocab_size",
    "pull",
    "resolve_model",
]


class ModelSource(NamedTuple):
    kind: str  # "gguf" | "hf" | "dummy"
    path: Path
    name: str  # the name the model is served under


class ModelNotFoundError(InvalidParameterError):
    """`model` names nothing loadable; the message says what was tried and what to do."""

    def __init__(self, message: str):
        super().__init__(message, param="model", code="model_not_found")


def resolve_model(model: str) -> ModelSource:
    """A cached registry name, a path to a .gguf file, an HF directory with config.json, or a
    Hub name `ORG/NAME[:TAG][@REVISION]` (fetched, or found in the cache when offline). An
    existing path wins over a Hub name of the same spelling."""
    if not isinstance(model, str) or not model.strip():
        raise ModelNotFoundError(f"model must be a non-empty string, got {model!r}")
    if model.lower().startswith("dummy:"):  # random weights at a built-in shape (speed tests)
        from servelm.loader.dummy import dummy_model_config

        try:
            config = dummy_model_config(model)
        except ValueError as e:
            raise ModelNotFoundError(str(e)) from None
        return ModelSource("dummy", Path(model), config.name)
    if model in model_cache.REGISTRY:
        path = cached_path(model)
        if path is None:
            raise ModelNotFoundError(
                f"model {model!r} is known but not downloaded yet; run "
                f"`servelm models pull {model}` first (cache: {model_cache.cache_home()})"
            )
        return ModelSource("gguf", path, model)
    path = Path(model).expanduser().resolve()  # absolute: "." still gets a served name
    if path.is_file() and _is_gguf(path):
        return ModelSource("gguf", path, path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    if not path.exists():
        from servelm.loader import hub_ref  # imports this package: not at the top

        if hub_ref.looks_like_hub_name(model):
            from servelm.loader import hub_cache  # huggingface_hub: only for a Hub name

            found = hub_cache.fetch(hub_ref.parse_hub_name(model), model)
            return ModelSource(found.kind, found.path, model)
    if path.is_dir():
        why = f"{path} is a directory without config.json"
    elif path.is_file():
        why = f"{path} is a file but not a GGUF file"
    else:
        why = f"no file or directory {path} exists"
    raise ModelNotFoundError(
        f"cannot load model {model!r}: it is not a registry name "
        f"({', '.join(sorted(model_cache.REGISTRY))}) and {why}. Pass a registry name (then "
        "`servelm models pull NAME`), a path to a .gguf file, a Hugging Face model "
        "directory containing config.json, *.safetensors and tokenizer.json, or a Hugging "
        "Face Hub name ORG/NAME[:TAG][@REVISION]."
    )


def _is_gguf(path: Path) -> bool:
    # The magic bytes decide, not the file name.
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_model_config(source: ModelSource) -> ModelConfig:
    from servelm.loader import gguf_loader, hf_loader  # torch/gguf: only when loading

    if source.kind == "gguf":
        return gguf_loader.load_gguf_config(source.path, source.name)
    if source.kind == "hf":
        return hf_loader.load_hf_config(source.path, source.name)
    if source.kind == "dummy":
        from servelm.loader.dummy import dummy_model_config

        return dummy_model_config(source.name)
    raise ValueError(f"unknown model source kind {source.kind!r}")


def model_vocab_size(model: str) -> int:
    """The vocabulary size of `model` (a registry name, .gguf file or HF directory): its
    ModelConfig's, the bound the engine checks prompt ids against. Reads the config only
    (a GGUF file's index), never the weights; raises ModelNotFoundError like resolve_model."""
    return load_model_config(resolve_model(model)).vocab_size


def iter_weights(source: ModelSource, config: ModelConfig, select=None,
                 dtype=None, skip=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF Llama name, CPU tensor) for every weight; `lm_head.weight` absent if tied.

    select: a model-parallel rank's `(name, view) -> (name, tensor) | None` (servelm/parallel/
    sharding.py); safetensors and GGUF then read only the slices it asks for (GGUF: rows, and
    column blocks where aligned), dummy weights are made whole and narrowed.
    dtype: the model's dtype, which safetensors weights are read into (a bfloat16 model's
    never pass through float32); None: float32, as every other source gives them.
    skip: `name -> bool`, tensors of a safetensors checkpoint left unread (modules the
    engine will not run, e.g. DeepSeek-V3's multi-token prediction without mtp)."""
    from servelm.loader import gguf_loader, hf_loader  # torch/gguf: only when loading

    if source.kind == "hf":
        return hf_loader.iter_hf_weights(source.path, config, select, dtype, skip)
    if source.kind == "gguf":
        return gguf_loader.iter_gguf_weights(source.path, config, select)
    if source.kind == "dummy":
        from servelm.loader.dummy import dummy_weights

        weights = dummy_weights(config, seed=0)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    if select is None:
        return weights
    return (picked for name, t in weights if (picked := select(name, t)) is not None)


def load_tokenizer(source: ModelSource) -> Tokenizer | None:
    """None for dummy models: they serve token ids only."""
    from servelm.loader import gguf_loader, hf_loader  # torch/gguf: only when loading

    if source.kind == "dummy":
        return None
    if source.kind == "gguf":
        return gguf_loader.load_gguf_tokenizer(source.path)
    if source.kind == "hf":
        return hf_loader.load_hf_tokenizer(source.path)
    raise ValueError(f"unknown model source kind {source.kind!r}")
