"""IOQueue: where the tiers' blocking work runs, off the engine's step.

Owns: one worker thread that runs file reads, writes and deletes in the order they were
queued (so a delete queued after a write finds the file, and the disk never holds more than
the tier has accounted for), and a deferred mode for tests: jobs run only when the engine
polls, so a reload takes at least one step, deterministically. Never: touches engine state;
a job's result is read on the engine thread.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor


class IOQueue:
    def __init__(self, threaded: bool = True):
        self.threaded = threaded
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="servelm-kv-io") if threaded \
            else None
        self._deferred: deque[tuple[Future, object, tuple]] = deque()

    def submit(self, fn, *args) -> Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        future: Future = Future()
        self._deferred.append((future, fn, args))
        return future

    def run_deferred(self) -> None:
        """Deferred mode: run what was queued before this call (the engine's poll)."""
        for _ in range(len(self._deferred)):
            future, fn, args = self._deferred.popleft()
            try:
                future.set_result(fn(*args))
            except Exception as e:  # noqa: BLE001 - handed to whoever reads the future
                future.set_exception(e)

    def drain(self) -> None:
        """Wait for everything queued so far (shutdown, tests)."""
        if self._pool is None:
            while self._deferred:
                self.run_deferred()
            return
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
