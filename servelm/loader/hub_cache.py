"""Hugging Face models in huggingface_hub's own cache: fetch, resolve offline, list.

Owns: turning a `HubRef` into a local path (a snapshot folder for safetensors, one .gguf file)
with huggingface_hub, which keeps its cache layout (`HF_HUB_CACHE`: blobs/, snapshots/<commit>/,
refs/), its progress bars, `HF_TOKEN` and `HF_HUB_OFFLINE`; mapping its exceptions to one-line
`HubModelError`s; listing the cached repositories servelm can serve.

Never: downloads a whole repository (only what hub_ref.select_hub_files chooses), writes the
cache itself, or imports huggingface_hub before a hub name is used.
"""

from __future__ import annotations

import errno
import functools
import glob
import json
import os
from pathlib import Path
from typing import NamedTuple

from servelm.loader.hub_ref import (
    SAFETENSORS_INDEX,
    HubFiles,
    HubModelError,
    HubRef,
    select_hub_files,
)

__all__ = ["HubModel", "fetch", "hub_cache_dir", "is_offline", "list_cached_hub_models"]


class HubModel(NamedTuple):
    kind: str  # "hf" (a snapshot folder) | "gguf" (one file in it)
    path: Path
    files: HubFiles


class CachedHubModel(NamedTuple):
    name: str  # what to pass as the model argument
    path: Path
    size: int  # bytes on disk of the files servelm would load


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now: huggingface_hub reads it once, when
    it is imported, which may be before a launcher or a test sets it."""
    from huggingface_hub import constants

    return (constants.is_offline_mode() or _env_flag("HF_HUB_OFFLINE")
            or _env_flag("TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder, from the environment as it is now (see is_offline)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def fetch(ref: HubRef, model: str, local_files_only: bool | None = None) -> HubModel:
    """The files of `ref` servelm needs, downloaded into the cache unless there already.

    local_files_only: None follows HF_HUB_OFFLINE. Offline, or when the Hub cannot be reached,
    the cache alone answers. Every failure a user can meet is a HubModelError naming `model`."""
    offline = is_offline() if local_files_only is None else local_files_only
    return _fetch_cached(ref, model, str(hub_cache_dir()), offline)


# Several parts of one process resolve the same model (tokenizer, engine, draft); one look-up
# at the Hub each is enough. Failures are not remembered.
@functools.lru_cache(maxsize=16)
def _fetch_cached(ref: HubRef, model: str, cache_dir: str, offline: bool) -> HubModel:
    from httpx2 import TransportError  # huggingface_hub 2's HTTP client: no connection
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    unreachable = (TransportError, OfflineModeIsEnabled)
    try:
        if offline:
            return _from_cache(ref, model, cache_dir)
        try:
            return _download(ref, model, cache_dir)
        except (*unreachable, HfHubHTTPError) as exc:
            if isinstance(exc, HfHubHTTPError) and _status(exc) not in {None, 500, 502, 503, 504}:
                raise
            try:
                return _from_cache(ref, model, cache_dir)
            except HubModelError:
                raise _hub_error(exc, ref, model, cache_dir) from exc
    except HubModelError:
        raise
    except Exception as exc:
        error = _hub_error(exc, ref, model, cache_dir)
        if error is None:
            raise
        raise error from exc


def _download(ref: HubRef, model: str, cache_dir: str) -> HubModel:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    info = HfApi().model_info(ref.repo_id, revision=ref.revision)
    chosen = select_hub_files((s.rfilename for s in info.siblings or ()), ref, model)
    if SAFETENSORS_INDEX in chosen.files:
        index = hf_hub_download(ref.repo_id, SAFETENSORS_INDEX, revision=ref.revision,
                                cache_dir=cache_dir)
        chosen = chosen.with_index(json.loads(Path(index).read_text(encoding="utf-8")))
    # Exact names as patterns: huggingface_hub matches them with fnmatch, so '[' is escaped.
    folder = snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache_dir,
                               allow_patterns=[glob.escape(f) for f in chosen.files])
    return _located(Path(folder), chosen)


def _from_cache(ref: HubRef, model: str, cache_dir: str) -> HubModel:
    """The snapshot of `ref.revision` already cached, its files chosen as online: from the
    repository's listing huggingface_hub cached at download, else from the files present."""
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError

    try:
        # No patterns: only the folder of the revision's commit is asked for.
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache_dir,
                                        local_files_only=True, allow_patterns=[]))
    except LocalEntryNotFoundError:
        raise _not_cached(ref, model, cache_dir) from None
    try:
        listed = [f.path for f in get_cached_repo_tree(ref.repo_id, revision=folder.name,
                                                       cache_dir=cache_dir)]
    except CachedRepoTreeNotFoundError:
        listed = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    chosen = select_hub_files(listed, ref, model)
    if SAFETENSORS_INDEX in chosen.files and (folder / SAFETENSORS_INDEX).is_file():
        chosen = chosen.with_index(json.loads((folder / SAFETENSORS_INDEX).read_text("utf-8")))
    missing = [f for f in chosen.files if not (folder / f).is_file()]  # a broken link is missing
    if missing:
        raise _not_cached(ref, model, cache_dir, missing)
    return _located(folder, chosen)


def _located(folder: Path, chosen: HubFiles) -> HubModel:
    if chosen.format == "gguf":
        return HubModel("gguf", folder / chosen.gguf_file, chosen)
    return HubModel("hf", folder, chosen)


def _not_cached(ref: HubRef, model: str, cache_dir: str, missing: list[str] | None = None,
                unreachable: BaseException | None = None) -> HubModelError:
    at = f" at revision {ref.revision!r}" if ref.revision else ""
    held = f" (missing {', '.join(missing[:4])})" if missing else ""
    if unreachable is None:
        why = "HF_HUB_OFFLINE allows no download"
    else:
        why = f"the Hub could not be reached ({_first_line(unreachable)})"
    return HubModelError(
        model, f"{ref.repo_id}{at} is not in the Hugging Face cache {cache_dir}{held}, and "
               f"{why}; run `servelm models pull {model}` where the Hub can be reached",
        code="model_not_cached")


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _hub_error(exc: BaseException, ref: HubRef, model: str,
               cache_dir: str) -> HubModelError | None:
    """One line for each failure a user can meet; None for the ones that are servelm's bugs."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from httpx2 import TransportError

    url = f"https://huggingface.co/{ref.repo_id}"
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError, its base class
        if get_token():
            why = (f"{ref.repo_id} is gated and the token in use (HF_TOKEN) has no access; "
                   f"accept its terms at {url} with that token's account")
        else:
            why = (f"{ref.repo_id} is gated; accept its terms at {url}, then set HF_TOKEN "
                   "(or run `hf auth login`)")
        return HubModelError(model, why, code="model_gated")
    if isinstance(exc, RepositoryNotFoundError):
        token = "" if get_token() else " (if it is private, set HF_TOKEN)"
        return HubModelError(model, f"no repository {ref.repo_id} on the Hugging Face Hub"
                                    f"{token}, and no local path of that name")
    if isinstance(exc, RevisionNotFoundError):
        return HubModelError(model, f"{ref.repo_id} has no revision {ref.revision!r}")
    if isinstance(exc, DisabledRepoError):
        return HubModelError(model, f"{ref.repo_id} is disabled on the Hugging Face Hub")
    if isinstance(exc, LocalEntryNotFoundError):
        return _not_cached(ref, model, cache_dir)
    if isinstance(exc, (TransportError, OfflineModeIsEnabled)):
        return _not_cached(ref, model, cache_dir, unreachable=exc)
    if isinstance(exc, RemoteEntryNotFoundError):
        return HubModelError(model, f"a file of {ref.repo_id} went missing on the Hub while "
                                    f"it was fetched ({_first_line(exc)}); try again")
    if isinstance(exc, HfHubHTTPError):
        return HubModelError(model, f"the Hugging Face Hub refused {ref.repo_id}: "
                                    f"{_first_line(exc)}", code="model_fetch_failed")
    if _is_disk_full(exc):
        return HubModelError(model, f"no space left on the device while downloading "
                                    f"{ref.repo_id} into {cache_dir}; free some, or set "
                                    "HF_HUB_CACHE to a larger disk", code="model_fetch_failed")
    if isinstance(exc, PermissionError):
        return HubModelError(model, f"cannot write the Hugging Face cache {cache_dir} "
                                    f"({exc.strerror}); set HF_HUB_CACHE to a writable folder",
                             code="model_fetch_failed")
    return None


def _is_disk_full(exc: BaseException | None) -> bool:
    # Xet and the thread pool wrap the OSError; follow the chain.
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def list_cached_hub_models() -> list[CachedHubModel]:
    """Every cached model revision servelm can serve, as the name that serves it: `ORG/NAME`
    for the default branch, `@REF` or `@COMMIT` for others, `:FILE.gguf` for each GGUF."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: r.commit_hash):
            found += _servable(repo.repo_id, revision)
    return found


def _servable(repo_id: str, revision) -> list[CachedHubModel]:
    sizes = {f.file_path.relative_to(revision.snapshot_path).as_posix(): f.size_on_disk
             for f in revision.files}
    refs = sorted(revision.refs) or [revision.commit_hash]
    at = ["" if r == "main" else f"@{r}" for r in refs]
    found = []
    try:
        chosen = select_hub_files(sizes, HubRef(repo_id, None, None), repo_id)
    except HubModelError:  # several GGUF files and no default among them: listed below
        chosen = None
    if chosen is not None and chosen.format == "safetensors":
        found += [CachedHubModel(f"{repo_id}{a}", revision.snapshot_path,
                                 sum(sizes[f] for f in chosen.files)) for a in at]
    ggufs = [f for f in sizes if f.lower().endswith(".gguf")
             and not Path(f).name.lower().startswith("mmproj")]
    found += [CachedHubModel(f"{repo_id}:{f}{a}", revision.snapshot_path / f, sizes[f])
              for a in at for f in sorted(ggufs)]
    return found
