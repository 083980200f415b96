"""Hugging Face caches written by huggingface_hub's own helpers (import as `hf_cache_layout`).

huggingface_hub has no public call that puts a local file into its cache, so each step uses
the function its downloads use for it: `repo_folder_name` (models--ORG--NAME), blobs named by
their etag (the git sha1 of a small file, the sha256 of an LFS one: `git_hash`, `sha_fileobj`),
`_create_symlink` from snapshots/<commit>/<path> to the blob,
`_cache_commit_hash_for_specific_revision` for refs/<revision>, and `write_tree_cache` for the
repository listing that snapshot_download stores (trees/<commit>.json). The tests read every
cache back with huggingface_hub itself (try_to_load_from_cache, snapshot_download offline,
scan_cache_dir), which is what shows the layout is the real one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

_LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def commit_hash(label: str) -> str:
    """A 40-hex commit id, distinct per label."""
    return hashlib.sha1(label.encode()).hexdigest()


def put_snapshot(cache_dir: Path, repo_id: str, files: dict[str, bytes | Path], *,
                 commit: str, refs: tuple[str, ...] = ("main",),
                 listed_only: dict[str, int] | None = None) -> Path:
    """Store `files` (repo path -> content, or a local file to take it from) as the snapshot
    of `commit`, point `refs` at it, and cache the repository listing: `files` plus
    `listed_only` (repo path -> size), files the repository has but were not downloaded.
    Returns the snapshot folder."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        repo_folder_name,
    )

    storage = Path(cache_dir) / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = storage / "snapshots" / commit
    entries = {}
    for path, content in files.items():
        blob, entry = _store_blob(storage / "blobs", path, content)
        pointer = snapshot / path
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=True)
        entries[path] = entry
    for path, size in (listed_only or {}).items():
        entries[path] = TreeCacheEntry(size=size, blob_id=commit_hash(path))
    snapshot.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        _cache_commit_hash_for_specific_revision(str(storage), ref, commit)
    write_tree_cache(str(storage), commit, entries)
    return snapshot


def _store_blob(blobs: Path, path: str, content: bytes | Path):
    from huggingface_hub._tree_cache import TreeCacheEntry
    from huggingface_hub.utils.sha import git_hash, sha_fileobj

    blobs.mkdir(parents=True, exist_ok=True)
    if isinstance(content, Path):
        with open(content, "rb") as f:
            sha256 = sha_fileobj(f).hex()
        size = content.stat().st_size
    else:
        sha256, size = hashlib.sha256(content).hexdigest(), len(content)
    if path.endswith(_LFS_SUFFIXES):  # LFS files: the blob is named by the content's sha256
        pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
                   f"size {size}\n").encode()
        etag = sha256
        entry = TreeCacheEntry(size=size, blob_id=git_hash(pointer), lfs_sha256=sha256,
                               lfs_size=size)
    else:
        data = content.read_bytes() if isinstance(content, Path) else content
        etag = git_hash(data)
        entry = TreeCacheEntry(size=size, blob_id=etag)
    blob = blobs / etag
    if not blob.exists():
        if isinstance(content, Path):
            try:  # a hard link keeps a 100 MB GGUF from being copied per test
                os.link(content, blob)
            except OSError:
                shutil.copyfile(content, blob)
        else:
            blob.write_bytes(content)
    return blob, entry
