"""SSEResponse: a text/event-stream ASGI response that never lets a client hold the server.

Owns: writing events with a per-write timeout (a reader stalled past it is dropped), and
watching the connection for a disconnect while events are produced, so the request is aborted
at once rather than at the next write.
Never: buffers events itself: it pulls the next event only after the previous write finished,
so a slow reader makes the producer coalesce (see RequestStream), not a queue grow.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from starlette.background import BackgroundTask
from starlette.responses import Response

logger = logging.getLogger(__name__)


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

    async def __call__(self, scope, receive, send) -> None:
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
        try:
            await asyncio.wait_for(send(message), self.write_timeout)
        except asyncio.TimeoutError:
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
