"""DiskTier: KV blocks in files under --kv-disk-dir, within --kv-disk-gb, kept across restarts.

Owns: the directory layout, the file format, an LRU index of the blocks on disk, the byte
limit (counted before a write is queued, so the directory never holds more than the limit,
whoever wrote the files), and finding the blocks of an earlier run again. Never: reads a
file another model, block layout or servelm version wrote; verifies a block against a
request (KVTiers does, with entry.verify, on the IO thread).

    <kv-disk-dir>/
      <fingerprint: 32 hex digits>/      one per (model, weights, KV layout, servelm version)
        MANIFEST.json                    what the fingerprint was made of (checked on start)
        <chain hash: 16 hex>.kvb         one block
      <another fingerprint>/ ...         another model's: counted in the limit, evicted first,
                                         never read

    block file = header | token ids (int64 each) | data
    header     = magic "SVLMKV01", chain hash, parent hash (int64), num tokens,
                 data bytes (uint32), blake2b-128 of data

Writes go through a temporary file and a rename, so a crash leaves a whole file or none;
temporary files found on start are deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections import OrderedDict, deque
from pathlib import Path

from servelm.kv_tiers.bandwidth import BandwidthMeter, MeteredTier
from servelm.kv_tiers.connector import TierStats
from servelm.kv_tiers.entry import CHECKSUM_BYTES, BlockEntry
from servelm.kv_tiers.io_queue import IOQueue

logger = logging.getLogger(__name__)

MAGIC = b"SVLMKV01"
_HEADER = struct.Struct(f"<8sqqII{CHECKSUM_BYTES}s")
SUFFIX = ".kvb"


def fingerprint_dir_name(fingerprint: dict) -> str:
    text = json.dumps(fingerprint, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def encode_block(entry: BlockEntry) -> bytes:
    n = len(entry.token_ids)
    return b"".join((_HEADER.pack(MAGIC, entry.hash, entry.parent_hash, n, len(entry.data),
                                  entry.checksum),
                     struct.pack(f"<{n}q", *entry.token_ids), entry.data))


def decode_block(raw: bytes) -> BlockEntry | None:
    """The entry in a block file's bytes; None when they are not one (truncated, foreign)."""
    if len(raw) < _HEADER.size:
        return None
    magic, h, parent, n, size, digest = _HEADER.unpack_from(raw)
    if magic != MAGIC or len(raw) != _HEADER.size + 8 * n + size:
        return None
    tokens = struct.unpack_from(f"<{n}q", raw, _HEADER.size)
    return BlockEntry(h, parent, tuple(tokens), raw[_HEADER.size + 8 * n:], digest)


class DiskTier(MeteredTier):
    name = "disk"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, fingerprint: dict,
                 io: IOQueue, probe_nbytes: int = 0):
        if capacity_bytes <= 0:
            raise ValueError(f"kv_disk_gb must be positive with kv_disk_dir, got "
                             f"{capacity_bytes} bytes")
        self.root = Path(root)
        self.io = io
        self.dir = self.root / fingerprint_dir_name(fingerprint)
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, oldest first
        self._foreign: deque[tuple[Path, int]] = deque()  # other fingerprints' files, oldest first
        self._foreign_bytes = 0
        self._pending: dict[int, BlockEntry] = {}  # queued writes: readable from memory
        self._done: deque[tuple[int, bool]] = deque()  # (hash, written) from the IO thread
        self._meter = BandwidthMeter()
        self._open(fingerprint)
        if probe_nbytes > 0:
            self._probe(probe_nbytes)

    # -- start-up ---------------------------------------------------------------------------

    def _open(self, fingerprint: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        manifest = self.dir / "MANIFEST.json"
        if manifest.exists():
            found = json.loads(manifest.read_text())
            if found != fingerprint:
                raise ValueError(f"kv_disk_dir: {self.dir} holds blocks of {found}, not of "
                                 f"this engine's {fingerprint}")
        else:
            manifest.write_text(json.dumps(fingerprint, sort_keys=True, indent=1) + "\n")
        own, foreign = [], []
        for path in self.root.rglob("*"):
            if not path.is_file() or path.name == "MANIFEST.json":
                continue
            st = path.stat()
            if path.parent == self.dir and path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write a crash cut short
            elif path.parent == self.dir and path.suffix == SUFFIX:
                own.append((st.st_mtime, path, st.st_size))
            else:
                foreign.append((st.st_mtime, path, st.st_size))
        for _, path, size in sorted(own, key=lambda t: t[0]):
            try:
                self._index[int(path.stem, 16)] = size
            except ValueError:
                foreign.append((0.0, path, size))
        for _, path, size in sorted(foreign, key=lambda t: t[0]):
            self._foreign.append((path, size))
            self._foreign_bytes += size
        st = self.stats
        st.used_bytes = sum(self._index.values()) + self._foreign_bytes
        st.num_blocks = len(self._index)
        self._make_room(0)  # a smaller limit than last time: trim now
        if self._index:
            logger.info("kv disk tier: %d blocks (%.1f MB) of an earlier run found in %s",
                        len(self._index), sum(self._index.values()) / 1e6, self.dir)

    def _probe(self, nbytes: int) -> None:
        path = self.dir / "bandwidth-probe.tmp"
        path.write_bytes(bytes(nbytes))
        try:
            self._meter.probe(lambda: len(path.read_bytes()))
        finally:
            path.unlink(missing_ok=True)

    # -- TierStore --------------------------------------------------------------------------

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._index

    def peek(self, block_hash: int) -> BlockEntry | None:
        """A block still waiting to be written is served from memory."""
        return self._pending.get(block_hash)

    def read(self, block_hash: int) -> BlockEntry | None:
        """On the IO thread. None: no such file, or not a block file."""
        try:
            raw = self.path(block_hash).read_bytes()
        except OSError:
            return None
        return decode_block(raw)

    def put(self, entry: BlockEntry) -> list[BlockEntry]:
        """Queue a write. The last tier: what it evicts is deleted, never handed on."""
        if entry.hash in self._index:
            self._index.move_to_end(entry.hash)
            return []
        size = _HEADER.size + 8 * len(entry.token_ids) + entry.num_bytes
        if size > self.stats.capacity_bytes:
            return []
        self._make_room(size)
        self._index[entry.hash] = size
        self._pending[entry.hash] = entry
        st = self.stats
        st.used_bytes += size
        st.num_blocks = len(self._index)
        st.num_stored += 1
        st.num_stored_bytes += entry.num_bytes
        self.io.submit(self._write, entry, self.path(entry.hash))
        return []

    def touch(self, block_hash: int) -> None:
        if block_hash in self._index:
            self._index.move_to_end(block_hash)

    def keep(self, block_hash: int) -> None:
        """Retention is kept in memory tiers; on disk a retained block is one more file in
        the LRU (the disk is the tier sized for a day of evictions)."""

    def unkeep(self, block_hash: int) -> None:
        """See keep."""

    def discard(self, block_hash: int) -> None:
        size = self._index.pop(block_hash, None)
        if size is None:
            return
        self._pending.pop(block_hash, None)
        self.stats.used_bytes -= size
        self.stats.num_blocks = len(self._index)
        self.io.submit(_unlink, self.path(block_hash))

    # -- housekeeping -----------------------------------------------------------------------

    def _make_room(self, size: int) -> None:
        """Delete other fingerprints' files first (never read again), then our oldest."""
        st = self.stats
        while st.used_bytes + size > st.capacity_bytes and self._foreign:
            path, old = self._foreign.popleft()
            self._foreign_bytes -= old
            st.used_bytes -= old
            self.io.submit(_unlink, path)
        while st.used_bytes + size > st.capacity_bytes and self._index:
            h, _ = next(iter(self._index.items()))
            self.discard(h)
            st.num_evicted += 1

    def _write(self, entry: BlockEntry, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_bytes(encode_block(entry))
            os.replace(tmp, path)
            ok = True
        except OSError as e:
            logger.warning("kv disk tier: could not write %s: %s", path, e)
            tmp.unlink(missing_ok=True)
            ok = False
        self._done.append((entry.hash, ok))

    def poll(self) -> None:
        """Engine thread: writes the IO thread finished no longer need their memory copy."""
        while self._done:
            h, ok = self._done.popleft()
            entry = self._pending.pop(h, None)
            if not ok and entry is not None:
                self.discard(h)
                self.stats.num_failed += 1

    def check_invariants(self) -> None:
        st = self.stats
        assert st.used_bytes == sum(self._index.values()) + self._foreign_bytes
        assert st.used_bytes <= st.capacity_bytes
        assert st.num_blocks == len(self._index)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def bytes_on_disk(root: str | os.PathLike) -> int:
    """Every file's size under root (tests: the limit holds on the disk itself)."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file()
               and p.name != "MANIFEST.json")


__all__ = ["DiskTier", "bytes_on_disk", "decode_block", "encode_block",
           "fingerprint_dir_name"]
