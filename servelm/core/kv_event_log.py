"""KVEventLog: the front end's bounded log of its engine's prefix-cache events.

Owns: a ring of the last `capacity` KVEvents with consecutive sequence numbers, and the
reads a router makes (`since(n)`: every event numbered n and above, or a reset when some of
them have already been dropped). Thread-safe: the in-process engine thread appends while
the event loop reads.
Never: grows without bound (a router that falls behind gets reset=True and rebuilds its view
from the events still held, which may miss blocks cached long ago: the view is approximate).
"""

from __future__ import annotations

import threading
from collections import deque

from servelm.core.contract import KVEvent


class KVEventLog:
    def __init__(self, capacity: int = 65536):
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._next = 0  # sequence number of the next event appended
        self._lock = threading.Lock()

    @property
    def next_seq(self) -> int:
        return self._next

    def extend(self, events: list[KVEvent]) -> None:
        with self._lock:
            self._events.extend(events)
            self._next += len(events)

    def since(self, seq: int, limit: int = 20000) -> tuple[list[KVEvent], int, bool]:
        """(events numbered seq.., the number to ask for next, reset). reset: events before
        the first returned were dropped (or seq is from another log): start the view anew."""
        with self._lock:
            first = self._next - len(self._events)
            reset = seq < first or seq > self._next
            start = first if reset else seq
            events = list(self._events)[start - first:start - first + limit]
            return events, start + len(events), reset


__all__ = ["KVEventLog"]
