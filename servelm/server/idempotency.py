"""Idempotency-Key: a retried request attaches to the first one instead of running twice.

Owns: a bounded, time-limited map from (route, key) to the one producer task serving it and
what that task has produced so far (SSE events for a stream, the finished response
otherwise). Any number of HTTP connections read the same entry; none of them owns the
generation, so a client that drops and retries finds its request still running, or its
result, for `ttl_s` after it finished.
Never: stores a refusal (4xx before admission, 429, 503): a retry of those runs again.

    POST (key K) -> new entry, producer task --events/result--> entry <- reader 1
    POST (key K, same body) ------------------------------------------> reader 2 (replay+follow)
    POST (key K, other body) -> 409 idempotency_key_reused
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from servelm.server.errors import APIError

MAX_KEY_LEN = 255


@dataclass
class IdempotencyEntry:
    fingerprint: str
    created: float = field(default_factory=time.monotonic)
    finished: float | None = None
    # Set when the request was admitted (or refused: then it holds the APIError).
    ready: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                  .create_future())
    events: list[str] = field(default_factory=list)  # streaming: SSE events so far
    result: Any = None  # non-streaming: the finished response
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    async def follow(self) -> AsyncIterator[str]:
        """Every event from the first, then live ones until the producer finishes."""
        i = 0
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.finished is not None:
                return
            self.changed.clear()
            await self.changed.wait()

    def _notify(self) -> None:
        self.changed.set()


def fingerprint(route: str, body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(f"{route}\n{canon}".encode()).hexdigest()


class IdempotencyStore:
    def __init__(self, ttl_s: float = 600.0, max_entries: int = 1024):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], IdempotencyEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _evict(self) -> None:
        now = time.monotonic()
        for k, e in list(self._entries.items()):
            if e.finished is not None and now - e.finished > self.ttl_s:
                del self._entries[k]
        # Over the cap: drop the oldest finished ones (running ones are bounded by the queue).
        for k, e in list(self._entries.items()):
            if len(self._entries) <= self.max_entries:
                break
            if e.finished is not None:
                del self._entries[k]

    def lookup(self, route: str, key: str, fp: str) -> IdempotencyEntry | None:
        if not key or len(key) > MAX_KEY_LEN:
            raise APIError(400, f"Idempotency-Key must be 1 to {MAX_KEY_LEN} characters",
                           param="Idempotency-Key", code="invalid_idempotency_key")
        self._evict()
        entry = self._entries.get((route, key))
        if entry is not None and entry.fingerprint != fp:
            raise APIError(409, "Idempotency-Key was already used with a different request body",
                           param="Idempotency-Key", code="idempotency_key_reused")
        return entry

    def start(self, route: str, key: str, fp: str,
              produce: Callable[[IdempotencyEntry], Awaitable[None]]) -> IdempotencyEntry:
        """A new entry whose producer runs independently of any connection."""
        entry = IdempotencyEntry(fp)
        self._entries[(route, key)] = entry

        async def run() -> None:
            try:
                await produce(entry)
            except APIError as exc:  # refused: do not remember it
                if self._entries.get((route, key)) is entry:
                    del self._entries[(route, key)]
                if not entry.ready.done():
                    entry.ready.set_exception(exc)
            except BaseException as exc:
                if self._entries.get((route, key)) is entry:
                    del self._entries[(route, key)]
                if not entry.ready.done():
                    entry.ready.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            finally:
                entry.finished = time.monotonic()
                entry._notify()
                if entry.ready.done() and not entry.ready.cancelled():
                    entry.ready.exception()  # retrieved: readers may all be gone

        entry.task = asyncio.ensure_future(run())
        return entry

    def cancel_all(self) -> None:
        for e in self._entries.values():
            if e.task is not None and not e.task.done():
                e.task.cancel()
