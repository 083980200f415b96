"""SSEResponse: a text/event-stream ASGI response that never lets a client hold the server.

Owns: writing events with a per-write timeout (a reader stalled past it is dropped), and
watching the connection for a disconnect while events are produced, so the request is aborted
at once rather than at the next write, and `StreamStats` (when each write started, how long
writes waited on the client's socket) for the request record, visible to code running in the
response's context through `current_stream_stats()`.
Never: buffers events itself: it pulls the next event only after the previous write finished,
so a slow reader makes the producer coalesce (see RequestStream), not a queue grow.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.background import BackgroundTask
from starlette.responses import Response

logger = logging.getLogger(__name__)

_MAX_WRITE_TIMES = 64  # start instants kept of a stream's first writes (delivery lag)


@dataclass
class StreamStats:
    """What writing one stream cost: seconds spent awaiting writes (a reader that does not
    keep up makes them wait on the transport's flow control) and the first writes' starts."""

    blocked_s: float = 0.0
    num_writes: int = 0
    write_starts: list[float] = field(default_factory=list)

    def first_write_after(self, t: float) -> float | None:
        """Start of the first write that began at or after `t` (monotonic seconds)."""
        return next((w for w in self.write_starts if w >= t), None)


_STREAM_STATS: contextvars.ContextVar[StreamStats | None] = contextvars.ContextVar(
    "servelm_stream_stats", default=None)


def current_stream_stats() -> StreamStats | None:
    """The StreamStats of the SSE response being written in this context, if any."""
    return _STREAM_STATS.get()


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], *, write_timeout: float,
                 on_disconnect: Callable[[str], None], on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None, status_code: int = 200):
        self.events = events
        self.write_timeout = write_timeout
        self.on_disconnect = on_disconnect  # called with "disconnect" or "write_timeout"
        self.on_close = on_close
        self.status_code = status_code
        self.dropped: str | None = None
        self._complete = False
        self.background: BackgroundTask | None = None
        self.body = b""
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self.raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                             for k, v in (headers or {}).items()]
        self.stats = StreamStats()

    async def __call__(self, scope, receive, send) -> None:
        _STREAM_STATS.set(self.stats)
        watcher = asyncio.ensure_future(self._watch_disconnect(receive))
        try:
            await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
            async for event in self.events:
                if self.dropped:
                    break
                await self._send(send, {"type": "http.response.body",
                                        "body": event.encode("utf-8"), "more_body": True})
            if not self.dropped:
                self._complete = True  # a disconnect from now on is the normal end
                await self._send(send, {"type": "http.response.body", "body": b"",
                                        "more_body": False})
        except (_Dropped, OSError):
            pass
        finally:
            watcher.cancel()
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                self.on_close()
        if self.background is not None and not self.dropped:
            await self.background()

    async def _send(self, send, message) -> None:
        if self.dropped:
            raise _Dropped
        if self._complete:
            await send(message)
            return
        start = time.monotonic()
        stats = self.stats
        if len(stats.write_starts) < _MAX_WRITE_TIMES:
            stats.write_starts.append(start)
        try:
            await asyncio.wait_for(send(message), self.write_timeout)
            stats.num_writes += 1
            stats.blocked_s += time.monotonic() - start
        except asyncio.TimeoutError:
            stats.blocked_s += time.monotonic() - start
            self._drop("write_timeout")
            raise _Dropped from None
        except Exception:  # the transport is gone (uvicorn raises on a closed socket)
            self._drop("disconnect")
            raise _Dropped from None

    async def _watch_disconnect(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._drop("disconnect")
                return

    def _drop(self, why: str) -> None:
        if self.dropped is None and not self._complete:
            self.dropped = why
            logger.info("stream dropped: %s", why)
            self.on_disconnect(why)


class _Dropped(Exception):
    pass
