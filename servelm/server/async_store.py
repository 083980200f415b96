"""AsyncStore: the state store as the event loop calls it (every call on a worker thread).

Owns: opening the store a `--state-store` URL names on first use (once, for every endpoint
and the batch runner) and closing it.
Never: calls the store on the event loop, or caches what the store holds.
"""

from __future__ import annotations

import asyncio
from typing import Any

from servelm.server.state_store import StateStore, open_state_store


class AsyncStore:
    def __init__(self, url: str | None):
        self.url = url
        self._store: StateStore | None = None
        self._lock: asyncio.Lock | None = None

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """store.method(*args, **kwargs) on a worker thread."""
        if self._store is None:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if self._store is None:
                    self._store = await asyncio.to_thread(open_state_store, self.url)
        return await asyncio.to_thread(getattr(self._store, method), *args, **kwargs)

    async def close(self) -> None:
        if self._store is not None:
            store, self._store = self._store, None
            await asyncio.to_thread(store.close)


__all__ = ["AsyncStore"]
