"""A GGUF file's metadata and tensor table, parsed once per file and kept on disk.

gguf-py's GGUFReader walks every metadata array element by element through numpy views:
for a 50k-token vocabulary that is seconds of every start-up (3.6 s for the default model on
the CI machine), and both the front end (the tokenizer) and the engine core (config, weights,
tokenizer) ask. The index holds what the loader reads -- each field's value and, per tensor,
its name, ggml type, shape and where its bytes lie -- as one msgpack file under
`$SERVELM_HOME/index/`, so a later start reads it in milliseconds and memory-maps the tensors.

Owns: building the index from a GGUFReader, the cache key (the file's resolved path, size and
modification time, gguf-py's version and this module's format version), and a reader-shaped
view (`fields[key].contents()`, `tensors[i].name / tensor_type / shape / data`) so the loader's
code is the same whichever it gets.
Never: writes into the model file, or trusts an index whose key does not match the file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from servelm.slow_step import say_if_slow

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


class _TensorEntry(msgspec.Struct, array_like=True):
    name: str
    ggml_type: int
    shape: list[int]  # ggml's ne order, as GGUFReader gives it
    offset: int  # absolute byte offset of the data in the file
    dtype: str  # numpy dtype of `data` (uint8 rows for block-quantized types)
    data_shape: list[int]


class _Index(msgspec.Struct):
    key: str
    fields: dict[str, Any]
    tensors: list[_TensorEntry]


class _Field:
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def contents(self) -> Any:
        return self.value


@dataclass
class IndexedTensor:
    """What the loader reads of a GGUFReader's ReaderTensor, backed by the file's memmap."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    _entry: _TensorEntry
    _file: IndexedGGUF

    @cached_property
    def data(self) -> np.ndarray:
        e = self._entry
        dtype = np.dtype(e.dtype)
        count = int(np.prod(e.data_shape)) if e.data_shape else 1
        flat = self._file.memmap[e.offset:e.offset + count * dtype.itemsize]
        return flat.view(dtype).reshape(e.data_shape)


class IndexedGGUF:
    """A GGUF file seen through its index: the reader's fields and tensors, no parsing."""

    def __init__(self, path: Path, index: _Index, from_cache: bool):
        from gguf import GGMLQuantizationType

        self.path = path
        self.from_cache = from_cache
        self.fields = {k: _Field(v) for k, v in index.fields.items()}
        self.tensors = [IndexedTensor(e.name, GGMLQuantizationType(e.ggml_type),
                                      np.array(e.shape, dtype=np.uint64), e, self)
                        for e in index.tensors]

    @cached_property
    def memmap(self) -> np.memmap:
        return np.memmap(self.path, mode="r")


def index_key(path: Path) -> str:
    st = path.stat()
    try:
        gguf_version = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        gguf_version = "unknown"
    ident = f"{FORMAT_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{gguf_version}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def build_index(path: Path, key: str) -> _Index:
    from gguf import GGUFReader

    reader = GGUFReader(path, "r")
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = [_TensorEntry(t.name, int(t.tensor_type), [int(x) for x in t.shape],
                            int(t.data_offset), t.data.dtype.str, list(t.data.shape))
               for t in reader.tensors]
    return _Index(key, fields, tensors)


def index_dir() -> Path:
    from servelm.loader.model_cache import cache_home

    return cache_home() / "index"


def open_indexed(path: Path, use_cache: bool = True) -> IndexedGGUF:
    """The file's index: from `$SERVELM_HOME/index/` when a matching one is there, else
    parsed now (and written there for the next start; an unwritable cache is only logged)."""
    key = index_key(path)
    cached = index_dir() / f"{key}.msgpack"
    if use_cache and cached.is_file():
        try:
            index = msgspec.msgpack.decode(cached.read_bytes(), type=_Index)
            if index.key == key:
                return IndexedGGUF(path, index, from_cache=True)
        except (msgspec.DecodeError, OSError) as exc:
            logger.warning("ignoring unreadable GGUF index %s (%s); parsing the file", cached,
                           exc)
    with say_if_slow(f"parsing the GGUF metadata of {path.name} (once per file: indexed under "
                     f"{index_dir()} for later starts)"):
        index = build_index(path, key)
    if use_cache:
        _write_atomic(cached, msgspec.msgpack.encode(index))
    return IndexedGGUF(path, index, from_cache=False)


def _write_atomic(target: Path, data: bytes) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
    except OSError as exc:
        logger.warning("could not cache the GGUF index at %s: %s", target, exc)
