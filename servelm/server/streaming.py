"""Streaming a started generation, and watching the client's connection.

Owns: the chunks of one started generation as the formatter shapes them (the first chunks,
a chunk per delta, the finish chunks, the usage chunk; a failure after the start is one last
`{"error": ...}` chunk; a deadline with nothing generated is a timeout chunk), the same
chunks as SSE events ending with [DONE], and waiting for a client's disconnect.
Never: starts or admits a generation (serving.py does), or writes to the socket (the
SSEResponse in sse.py does, with its write timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request

from servelm.engine.async_engine import EngineDeadError
from servelm.server.admission import Prepared
from servelm.server.errors import APIError
from servelm.server.formatting import SSE_DONE, Formatter, sse
from servelm.server.generation import ClientGone, Generation

logger = logging.getLogger(__name__)


async def sse_events(gen: Generation, fmt: Formatter, p: Prepared) -> AsyncIterator[str]:
    """SSE events of one started generation, ending with [DONE] (unless the client left)."""
    try:
        async with aclosing(stream_chunks(gen, fmt, p)) as chunks:
            async for chunk in chunks:
                yield sse(chunk)
    except ClientGone:
        return
    yield SSE_DONE


async def stream_chunks(gen: Generation, fmt: Formatter, p: Prepared
                        ) -> AsyncIterator[dict[str, Any]]:
    """The stream chunks of one started generation; a failure after the start is one
    last `{"error": ...}` chunk; ClientGone when the client left (the Responses API
    reads the same chunks). Each `await gen.stream.get()` takes everything pending,
    merged per choice."""
    try:
        for i in range(gen.num_choices):
            for chunk in fmt.first_chunks(i, p.prompt_texts[i // gen.n]):
                yield chunk
        while True:
            deltas = await gen.stream.get()
            if not deltas:
                break
            if (gen.deadline_hit and gen.num_completion_tokens == 0
                    and not any(d.token_ids for d in deltas)):
                gen.status = "timeout"
                yield gen.timeout_error().body()
                return
            for d in deltas:
                i, reason = gen.apply(d)
                if d.text or d.logprobs:
                    chunk = fmt.delta_chunk(i, d)
                    if chunk is not None:
                        yield chunk
                if reason is not None:
                    for chunk in fmt.finish_chunks(i, reason):
                        yield chunk
        if p.request.include_usage:
            yield fmt.usage_chunk(gen.usage(), gen.timing())
    except ClientGone:
        raise
    except Exception as exc:  # mid-stream failure: an error chunk
        logger.exception("stream %s failed", gen.base_id)
        gen.status = "error"
        err = APIError(500, f"generation failed: {exc}", "server_error",
                       code="engine_unavailable" if isinstance(exc, EngineDeadError)
                       else "internal_error")
        yield err.body()
    finally:
        gen.close("finished")


async def wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_ready_or_disconnect(fut, request: Request) -> None:
    """Waits for `fut` (re-raising its refusal); ClientGone if the client leaves first."""
    watcher = asyncio.ensure_future(wait_disconnect(request))
    waiter = asyncio.ensure_future(asyncio.shield(fut))
    try:
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:
            waiter.result()  # re-raise a refusal
            return
        raise ClientGone("disconnect")
    finally:
        watcher.cancel()
        if not waiter.done():
            waiter.cancel()
