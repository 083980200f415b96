"""Prepared weights: a model's float parameters after loading, kept on disk for the next start.

Loading a GGUF file dequantizes every tensor (2-3 s for the default model on the CI machine)
and then copies, fuses (q/k/v, gate/up) and un-permutes the rows into the model's own
parameters (1-1.5 s more). None of it changes between two starts of the same file with the
same code, so the first start writes the finished state dict as one safetensors file under
`$SERVELM_HOME/prepared/` and later ones read it back (a page-cache copy) and assign its
tensors to the model as they are.

Owns: the cache key -- the checkpoint's files (resolved path, size, modification time), the
dtype, the model class, and a hash of the sources that decide the parameters' names and
values (servelm/models, servelm/layers, servelm/loader, servelm/config), so a code change
never meets a stale entry -- writing atomically, a size cap with least-recently-used
eviction, and refusing what it cannot hold (quantized layers, non-CPU devices, tiny models).
Never: holds a file it could not have written whole (a torn write is a temp file, never an
entry), or reads one whose tensors do not match the model's state dict.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from functools import lru_cache
from pathlib import Path

import torch

from servelm.slow_step import say_if_slow

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MIN_BYTES = 16 * 2**20  # below this the checkpoint loads about as fast as the cache reads
CAP_BYTES = int(os.environ.get("SERVELM_PREPARED_CACHE_BYTES", 16 * 2**30))
_CODE_DIRS = ("models", "layers", "loader", "config")


def prepared_dir() -> Path:
    from servelm.loader.model_cache import cache_home

    return cache_home() / "prepared"


@lru_cache(maxsize=1)
def code_hash() -> str:
    root = Path(__file__).resolve().parent.parent  # the servelm package
    h = hashlib.sha256()
    files = []
    for d in _CODE_DIRS:
        files += sorted((root / d).glob("*.py"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def checkpoint_files(source) -> list[Path]:
    """The files a ModelSource's weights come from."""
    if source.kind == "gguf":
        return [source.path]
    if source.kind == "hf":
        return sorted(source.path.glob("*.safetensors")) + sorted(source.path.glob("*.bin"))
    return []


def prepared_key(source, model_class: type, dtype: torch.dtype) -> str | None:
    """The entry's name for these weights, or None where they are not cached."""
    files = checkpoint_files(source)
    if not files:
        return None
    total = 0
    h = hashlib.sha256(f"{FORMAT_VERSION}|{model_class.__module__}.{model_class.__qualname__}"
                       f"|{dtype}|{code_hash()}".encode())
    for f in files:
        st = f.stat()
        total += st.st_size
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    if total < MIN_BYTES:
        return None
    return h.hexdigest()[:32]


def load(key: str) -> dict[str, torch.Tensor] | None:
    """The entry's state dict, or None (absent or unreadable: the caller loads the checkpoint)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = prepared_dir() / f"{key}.safetensors"
    if not path.is_file():
        return None
    try:
        with say_if_slow(f"reading the prepared weights {path}"):
            state = load_file(path)
    except (SafetensorError, OSError, RuntimeError) as exc:
        logger.warning("ignoring unreadable prepared weights %s (%s)", path, exc)
        return None
    try:
        os.utime(path)  # least recently used goes first
    except OSError:
        pass
    return state


def cacheable(model: torch.nn.Module) -> bool:
    state = model.state_dict()
    return bool(state) and all(type(t) is torch.Tensor and t.device.type == "cpu"
                               and t.layout == torch.strided for t in state.values())


def save(key: str, model: torch.nn.Module) -> float:
    """Write the model's state dict as the entry (atomically); seconds spent, 0 if not."""
    from safetensors.torch import save_file

    start = time.monotonic()
    target = prepared_dir() / f"{key}.safetensors"
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    size = sum(t.numel() * t.element_size() for t in state.values())
    if size > CAP_BYTES:
        return 0.0
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with say_if_slow(f"writing the prepared weights ({size / 2**20:.0f} MiB) to "
                         f"{target.parent}, for the next start of this checkpoint"):
            _evict(target.parent, CAP_BYTES - size)
            save_file(_unshared(state), tmp,
                      metadata={"servelm_prepared": str(FORMAT_VERSION)})
            os.replace(tmp, target)
    except OSError as exc:
        logger.warning("could not cache prepared weights at %s: %s", target, exc)
        tmp.unlink(missing_ok=True)
        return 0.0
    return time.monotonic() - start


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied weights): give repeats their own."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _evict(folder: Path, budget: int) -> None:
    """Remove least recently used entries until the rest fit in `budget` bytes."""
    entries = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    used = sum(p.stat().st_size for p in entries)
    for p in entries:
        if used <= budget:
            break
        used -= p.stat().st_size
        p.unlink(missing_ok=True)
        logger.info("prepared weights cache: evicted %s", p.name)
