"""Hugging Face model names, `ORG/NAME[:TAG][@REVISION]`, and which repository files serve one.

Owns: parsing a model argument into a `HubRef` (the repository, a GGUF tag as llama.cpp's `-hf`
takes it: a quantization such as `Q4_K_M` or a file name such as `model.Q4_1.gguf`, and a git
revision), and choosing from a repository's file list the files servelm needs: config,
tokenizer and chat template with safetensors weights (the shards and their index), or one GGUF
file. The errors a user meets here are `HubModelError`s naming `model`, one line each.

Never: touches the network or a cache (hub_cache.py does), or imports huggingface_hub or torch:
everything here is a function of strings, so it is tested on file lists alone.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from servelm.loader import ModelNotFoundError

__all__ = [
    "HubFiles",
    "HubModelError",
    "HubRef",
    "looks_like_hub_name",
    "parse_hub_name",
    "select_hub_files",
]

SAFETENSORS_INDEX = "model.safetensors.index.json"

# What servelm reads beside safetensors weights (hf_loader.py); a repository's other files
# (README, pickled *.bin weights, other formats' weights, images) are never fetched.
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "quantize_config.json",  # older AutoGPTQ checkpoints' settings (loader/quantized_checkpoint.py)
)

# llama.cpp's `-hf` default when a repository holds several quantizations and no tag is given.
DEFAULT_GGUF_TAG = "Q4_K_M"

# The Hub's own rules for a repository id (huggingface_hub's validate_repo_id): word characters,
# '-' and '.', at most 96 a part, no '--' or '..', no '-' or '.' at either end of a part.
_REPO_PART = re.compile(r"^(?![-.])[\w.-]{1,96}(?<![-.])$", re.ASCII)
_QUANT_TAG = re.compile(r"^[A-Za-z0-9][\w.-]*$", re.ASCII)
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_LISTED = 12  # file names an error lists before it says how many more


class HubModelError(ModelNotFoundError):
    """A Hugging Face model argument cannot be served; the message says why and what to do."""

    def __init__(self, model: str, why: str, code: str = "model_not_found"):
        super().__init__(f"model {model!r}: {why}")
        self.code = code


class HubRef(NamedTuple):
    repo_id: str  # "ORG/NAME"
    tag: str | None  # a GGUF quantization ("Q4_K_M") or file name ("x.Q4_1.gguf")
    revision: str | None  # branch, tag or commit; None is the repository's default branch

    @property
    def is_gguf_file_tag(self) -> bool:
        return self.tag is not None and self.tag.lower().endswith(".gguf")


class HubFiles(NamedTuple):
    format: str  # "safetensors" | "gguf"
    files: tuple[str, ...]  # repository paths to fetch

    @property
    def gguf_file(self) -> str:
        assert self.format == "gguf"
        return self.files[0]

    def with_index(self, index: Mapping) -> HubFiles:
        """Only the shards `model.safetensors.index.json` maps weights to: a repository may
        hold other safetensors too (Mistral's `consolidated.safetensors`, another precision)."""
        weight_map = index.get("weight_map")
        if self.format != "safetensors" or not isinstance(weight_map, Mapping):
            return self
        shards = set(weight_map.values())
        kept = [f for f in self.files if not f.endswith(".safetensors") or f in shards]
        return self._replace(files=tuple(kept))


def looks_like_hub_name(model: str) -> bool:
    """Whether `model` is meant as `ORG/NAME...` rather than a path: one '/' before any
    `:TAG` or `@REVISION` (a file in a folder, or a revision such as `refs/pr/1`, may hold
    more) and no path-like start."""
    repo = model.split("@", 1)[0].split(":", 1)[0]
    return repo.count("/") == 1 and not repo.startswith(("/", ".", "~")) and "\\" not in repo


def parse_hub_name(model: str) -> HubRef:
    """`ORG/NAME[:TAG][@REVISION]` -> HubRef; a malformed name raises HubModelError."""
    head, has_rev, revision = model.partition("@")
    if has_rev and not revision:
        raise HubModelError(model, "an empty revision after '@'; write ORG/NAME@REVISION")
    if ":" in revision:
        raise HubModelError(
            model, "a revision cannot hold ':'; put the tag before it: ORG/NAME:TAG@REVISION")
    repo_id, has_tag, tag = head.partition(":")
    if has_tag and not tag:
        raise HubModelError(model, "an empty tag after ':'; write ORG/NAME:Q4_K_M or "
                                   "ORG/NAME:FILE.gguf")
    org, _, name = repo_id.partition("/")
    bad = [part for part in (org, name) if not _REPO_PART.match(part) or ".." in part
           or "--" in part]
    if bad or name.endswith(".git"):
        raise HubModelError(
            model, f"{repo_id!r} is not a Hugging Face repository id (ORG/NAME of letters, "
                   "digits, '-', '_' and '.', at most 96 each) nor an existing local path")
    if has_tag and not (tag.lower().endswith(".gguf") or _QUANT_TAG.match(tag)):
        raise HubModelError(
            model, f"tag {tag!r} is neither a quantization (such as Q4_K_M) nor a .gguf file name")
    return HubRef(repo_id, tag or None, revision or None)


def select_hub_files(files: Iterable[str], ref: HubRef, model: str) -> HubFiles:
    """The files of a repository (its paths, as the Hub lists them) that serve `ref`.

    A tag asks for GGUF. Without one, safetensors with config.json win over GGUF (they load
    unquantized, as the checkpoint was trained); a GGUF-only repository gives its one file, or
    the Q4_K_M file llama.cpp defaults to among several."""
    files = sorted(set(files))
    ggufs = [f for f in files if f.lower().endswith(".gguf")
             and not posixpath.basename(f).lower().startswith("mmproj")]
    if ref.tag is not None:
        return HubFiles("gguf", (_pick_gguf(ggufs, ref, model),))
    top = [f for f in files if "/" not in f]
    weights = _safetensors_weights(top)
    if weights and "config.json" in top:
        side = tuple(f for f in _SIDE_FILES if f in top)
        return HubFiles("safetensors", side + weights)
    if ggufs:
        return HubFiles("gguf", (_pick_gguf(ggufs, ref, model),))
    raise HubModelError(
        model, f"{ref.repo_id} has no weights servelm can serve (safetensors with config.json, "
               f"or a .gguf file); it has {_listing(files)}", code="model_format_unsupported")


def _safetensors_weights(top: list[str]) -> tuple[str, ...]:
    shards = [f for f in top if f.endswith(".safetensors")]
    if SAFETENSORS_INDEX in top:  # narrowed to the index's shards once it is read
        return (SAFETENSORS_INDEX, *shards)
    if "model.safetensors" in shards:
        return ("model.safetensors",)
    # Mistral's repositories ship their own format beside transformers' shards.
    return tuple(f for f in shards if not f.startswith("consolidated"))


def _pick_gguf(ggufs: list[str], ref: HubRef, model: str) -> str:
    if not ggufs:
        raise HubModelError(model, f"{ref.repo_id} has no .gguf file for tag {ref.tag!r}",
                            code="model_format_unsupported")
    if ref.is_gguf_file_tag:
        exact = [f for f in ggufs if ref.tag in (f, posixpath.basename(f))]
        folded = [f for f in ggufs if ref.tag.lower() in (f.lower(), posixpath.basename(f).lower())]
        if len(exact or folded) == 1:
            return (exact or folded)[0]
        raise HubModelError(model, f"{ref.repo_id} has no single file {ref.tag!r}; its GGUF files "
                                   f"are {_listing(ggufs)}", code="model_not_found")
    if ref.tag is None and len(ggufs) == 1:
        return ggufs[0]
    tag = ref.tag or DEFAULT_GGUF_TAG
    matches = [f for f in ggufs if _has_quant(f, tag)]
    if len(matches) == 1 and not _SPLIT_GGUF.search(matches[0]):
        return matches[0]
    if matches and all(_SPLIT_GGUF.search(f) for f in matches):
        why = (f"{tag} is a GGUF split into {len(matches)} parts ({_listing(matches)}), which "
               "servelm does not load; merge them with `llama-gguf-split --merge` and pass the "
               "file's path")
    elif matches:
        why = (f"tag {tag!r} matches several GGUF files ({_listing(matches)}); name one as "
               f"{ref.repo_id}:FILE.gguf")
    elif ref.tag is None:
        why = (f"{ref.repo_id} has several GGUF files and none is {DEFAULT_GGUF_TAG}; pick one "
               f"as {ref.repo_id}:TAG or {ref.repo_id}:FILE.gguf from {_listing(ggufs)}")
    else:
        why = f"no GGUF file of {ref.repo_id} is tagged {tag!r}; it has {_listing(ggufs)}"
    raise HubModelError(model, why, code="model_not_found")


def _has_quant(path: str, tag: str) -> bool:
    # The tag stands between separators: Q4_K must not pick Q4_K_M, whose '_' continues it.
    stem = path[: -len(".gguf")]
    return re.search(rf"(?:^|[-._/]){re.escape(tag)}(?:[-./]|$)", stem, re.IGNORECASE) is not None


def _listing(files: list[str]) -> str:
    if not files:
        return "no files"
    shown = ", ".join(files[:_LISTED])
    return shown if len(files) <= _LISTED else f"{shown} and {len(files) - _LISTED} more"
