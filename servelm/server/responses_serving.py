"""The Responses API endpoints: create (plain, streamed, background), retrieve, delete,
cancel, input_items.

Owns: a Responses request from validation to its stored body: the conversation it continues
(previous_response_id: each earlier turn's input items and output, oldest first, from the
store), the chat request it becomes (responses_schema.py) run by the chat path
(OpenAIServing: admission, chat template, parsers, structured outputs, logging), the
response built from the chat stream's chunks (responses_output.py), and background runs:
a task per run that heartbeats the store's lease and stops when the store says the response
was cancelled or deleted (by this replica or another sharing the store).
Never: keeps a response only in memory (the store holds every stored one; a run's task is
only the live part of it), or calls the store on the event loop (a worker thread does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from servelm.protocol import InvalidParameterError
from servelm.server.errors import APIError, read_json_object
from servelm.server.responses_output import ResponseBuilder
from servelm.server.responses_schema import (ResponsesRequest, chat_messages, check_fields,
                                             client_param, input_items, new_id)
from servelm.server.admission import Prepared
from servelm.server.generation import ClientGone, Generation
from servelm.server.serving import OpenAIServing
from servelm.server.streaming import stream_chunks, wait_disconnect
from servelm.server.sse import SSEResponse
from servelm.server.async_store import AsyncStore
from servelm.server.state_store import ACTIVE_STATUSES

logger = logging.getLogger(__name__)

_HEARTBEAT_S = 1.0  # a background run touches its lease (and reads cancels) this often
_MAX_CHAIN = 1000  # previous_response_id hops followed
_MAX_ITEMS = 10**6


@dataclass
class _Run:
    """A background response running in this process."""

    body: dict[str, Any]
    task: asyncio.Task | None = None
    gen: Generation | None = None
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.gen is not None:
            self.gen.cancel("cancelled")


@dataclass
class _Created:
    """A validated create request."""

    req: ResponsesRequest
    items: list[dict[str, Any]]
    prepared: Prepared
    builder: ResponseBuilder
    fmt: Any = None  # the chat formatter, once the generation is made


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id[:80]!r} not found.",
                    param="response_id", code="response_not_found")


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: AsyncStore):
        self.serving = serving
        self.state = serving.state
        self._db = store.call  # on a worker thread; the store is opened on first use
        self._runs: dict[str, _Run] = {}

    async def close(self) -> None:
        """Stop this process's background runs (their responses are stored as failed)."""
        for run in list(self._runs.values()):
            run.cancel()
            if run.task is not None:
                run.task.cancel()
            failed = dict(run.body, status="failed", output=[], error={
                "code": "server_error", "message": "the server stopped before it finished"})
            await self._db("update_response", failed, only_if_active=True)

    # -- POST /v1/responses ------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        state = self.state
        state.num_inflight += 1
        handed_off = False
        try:
            self.serving.admission.check()
            body = await read_json_object(request, self.state.config.max_body_bytes)
            created = await self._parse(body, request, arrival)
            if created.req.background:
                return await self._start_background(created)
            if created.req.stream:
                response = await self._start_stream(created)
                handed_off = True  # the SSE response decrements num_inflight when done
                return response
            return await self._complete(created, request)
        except APIError as exc:
            exc.param = client_param(exc.param)
            self.serving.admission.count_rejection(exc)
            return exc.response()
        finally:
            if not handed_off:
                state.num_inflight -= 1

    async def _parse(self, body: dict[str, Any], request: Request, arrival: float) -> _Created:
        try:
            check_fields(body)
            req = self.serving.admission.validate(ResponsesRequest, body)
            req.check()
            items = input_items(req.input)
            history = await self._history(req.previous_response_id)
        except InvalidParameterError as exc:
            raise APIError.from_invalid(exc) from None
        messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
        messages += chat_messages(history + items)
        chat = {"model": req.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True},
                "max_completion_tokens": req.max_output_tokens,
                "temperature": req.temperature, "top_p": req.top_p,
                "tools": req.chat_tools(), "tool_choice": req.chat_tool_choice(),
                "parallel_tool_calls": req.parallel_tool_calls,
                "response_format": req.text_format(),
                "structured_outputs": req.structured_outputs,
                "user": req.user or req.safety_identifier,
                "prompt_cache_key": req.prompt_cache_key,
                "prompt_cache_retention": req.prompt_cache_retention,
                "reasoning_effort": req.reasoning_effort(),
                "thinking_token_budget": req.thinking_token_budget}
        chat = {k: v for k, v in chat.items() if v is not None}
        prepared = await self.serving.admission.prepare("chat", chat, request, arrival)
        prepared.endpoint = "responses"
        return _Created(req, items, prepared, ResponseBuilder(self._body(req)))

    async def _history(self, response_id: str | None) -> list[dict[str, Any]]:
        """The stored items of every earlier turn, oldest first: each turn's input items,
        then its output."""
        turns: list[list[dict[str, Any]]] = []
        while response_id is not None:
            body = await self._db("get_response", response_id)
            if body is None or len(turns) >= _MAX_CHAIN:
                raise InvalidParameterError(
                    f"Previous response with id {response_id[:80]!r} not found.",
                    param="previous_response_id", code="previous_response_not_found")
            if body["status"] in ACTIVE_STATUSES:
                raise InvalidParameterError(f"Previous response {response_id[:80]!r} is "
                                            f"still {body['status']}",
                                            param="previous_response_id")
            page = await self._db("input_items", response_id, limit=_MAX_ITEMS, order="asc")
            turns.append(page.items + body["output"])
            response_id = body.get("previous_response_id")
        return [item for turn in reversed(turns) for item in turn]

    def _body(self, req: ResponsesRequest) -> dict[str, Any]:
        """The response as created: no output yet."""
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {"id": new_id("resp"), "object": "response", "created_at": int(time.time()),
                "status": "in_progress", "background": bool(req.background),
                "completed_at": None, "error": None, "incomplete_details": None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "max_tool_calls": None, "metadata": req.metadata or {},
                "model": req.model or self.state.config.served_model_name, "output": [],
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": req.reasoning_effort(), "summary": None},
                "service_tier": "default", "store": req.is_stored,
                "temperature": req.temperature, "text": {"format": fmt},
                "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
                "tools": req.tools or [], "top_p": req.top_p, "truncation": "disabled",
                "usage": None, "user": req.user, "safety_identifier": req.safety_identifier,
                "prompt_cache_key": req.prompt_cache_key,
                "prompt_cache_retention": req.prompt_cache_retention}

    # -- running -----------------------------------------------------------------------------

    async def _started(self, c: _Created) -> Generation:
        gen, fmt = self.serving.generation(c.prepared)
        c.fmt = fmt
        await self.serving.start(gen)  # 4xx before anything is sent or stored
        return gen

    async def _events(self, c: _Created, gen: Generation) -> AsyncIterator[dict[str, Any]]:
        """The events of a started generation up to the final one; the response is stored
        (store: true) before its final event goes out. ClientGone when it was cancelled."""
        try:
            async with aclosing(stream_chunks(gen, c.fmt, c.prepared)) as chunks:
                async for chunk in chunks:
                    for event in c.builder.feed(chunk):
                        yield event
        finally:
            self.serving.log(gen, c.prepared)
        final = c.builder.finish()
        if c.req.is_stored:
            await self._db("put_response", c.builder.body, c.items)
        for event in final:
            yield event

    async def _complete(self, c: _Created, request: Request) -> Response:
        gen = await self._started(c)

        async def collect() -> None:
            async for _ in self._events(c, gen):
                pass

        task = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                gen.status = "client_disconnected"
                gen.cancel("disconnect")
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)  # nobody reads it
            task.result()
        finally:
            watcher.cancel()
        body = c.builder.body
        if body["status"] == "failed" and c.builder.error is not None:
            return _failure(c.builder.error)
        return JSONResponse(body)

    async def _start_stream(self, c: _Created) -> SSEResponse:
        gen = await self._started(c)
        state = self.state

        async def events() -> AsyncIterator[str]:
            try:
                for event in c.builder.start():
                    yield _sse(event)
                async with aclosing(self._events(c, gen)) as inner:
                    async for event in inner:
                        yield _sse(event)
            except ClientGone:
                return

        def on_disconnect(why: str) -> None:
            gen.status = "client_disconnected" if why == "disconnect" else "write_timeout"
            gen.cancel(why)

        def on_close() -> None:
            state.num_inflight -= 1

        return SSEResponse(events(), write_timeout=self.state.config.write_timeout,
                           on_disconnect=on_disconnect, on_close=on_close)

    # -- background ---------------------------------------------------------------------------

    async def _start_background(self, c: _Created) -> Response:
        body = c.builder.body
        body["status"] = "queued"
        await self._db("put_response", body, c.items)
        run = self._runs[body["id"]] = _Run(body)
        run.task = asyncio.ensure_future(self._background(c, run))
        return JSONResponse(body)

    async def _background(self, c: _Created, run: _Run) -> None:
        """Runs a background response to its end; a cancel or delete (the store says so)
        stops it."""
        body = c.builder.body
        self.state.num_inflight += 1  # a drain waits for it like for a connection
        heartbeat = None
        try:
            body["status"] = "in_progress"
            if run.cancelled or not await self._db("update_response", body,
                                                   only_if_active=True):
                return
            run.gen = await self._started(c)
            if run.cancelled:  # cancelled while it waited for admission
                run.cancel()
            heartbeat = asyncio.ensure_future(self._heartbeat(body["id"], run))
            async for _ in self._events_unstored(c, run.gen):
                pass
            c.builder.finish()
        except ClientGone:
            c.builder.finish(cancelled=True)
        except APIError as exc:
            body.update(status="failed", error={"code": "server_error", "message": exc.message})
        except Exception as exc:  # the response fails; the server goes on
            logger.exception("background response %s failed", body["id"])
            body.update(status="failed", error={"code": "server_error", "message": str(exc)})
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            self._runs.pop(body["id"], None)
            self.state.num_inflight -= 1
        if not run.cancelled:
            await self._db("update_response", body, only_if_active=True)

    async def _events_unstored(self, c: _Created, gen: Generation):
        """A background run's events: its body is written by _background (a conditional
        update), not stored anew."""
        try:
            async with aclosing(stream_chunks(gen, c.fmt, c.prepared)) as chunks:
                async for chunk in chunks:
                    yield c.builder.feed(chunk)
        finally:
            self.serving.log(gen, c.prepared)

    async def _heartbeat(self, response_id: str, run: _Run) -> None:
        try:
            while True:
                await asyncio.sleep(_HEARTBEAT_S)
                if not await self._db("heartbeat", response_id):
                    run.cancel()  # cancelled or deleted, maybe by another replica
                    return
        except asyncio.CancelledError:
            pass
        except Exception:  # a store outage: the run goes on; its lease may run out
            logger.exception("heartbeat of background response %s failed", response_id)

    # -- GET / DELETE / cancel / input_items -------------------------------------------------

    async def retrieve(self, response_id: str, request: Request) -> Response:
        _refuse_query(request, ("stream", "starting_after", "include", "include_obfuscation"))
        body = await self._db("get_response", response_id)
        if body is None:
            raise _not_found(response_id)
        return JSONResponse(body)

    async def delete(self, response_id: str) -> Response:
        """Forgets it; a background run of it stops (here at once, elsewhere at its next
        heartbeat)."""
        if not await self._db("delete_response", response_id):
            raise _not_found(response_id)
        run = self._runs.get(response_id)
        if run is not None:
            run.cancel()
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str) -> Response:
        """A queued or running background response becomes cancelled; a finished one is
        returned as it is (cancelling twice is harmless)."""
        body = await self._db("get_response", response_id)
        if body is None:
            raise _not_found(response_id)
        if not body.get("background"):
            raise APIError(400, "Only responses created with background can be cancelled.",
                           param="response_id", code="not_background")
        if body["status"] in ACTIVE_STATUSES:
            body = dict(body, status="cancelled")
            if not await self._db("update_response", body, only_if_active=True):
                body = await self._db("get_response", response_id)  # it finished meanwhile
            run = self._runs.get(response_id)
            if run is not None:
                run.cancel()
        if body is None:
            raise _not_found(response_id)
        return JSONResponse(body)

    async def list_input_items(self, response_id: str, request: Request) -> Response:
        _refuse_query(request, ("include",))
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be asc or desc, got {order[:16]!r}", param="order")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise APIError(400, "limit must be an integer from 1 to 100", param="limit")
        after = query.get("after")
        try:
            page = await self._db("input_items", response_id, after=after, limit=limit,
                                  order=order)
        except KeyError:
            raise APIError(400, f"after: no input item {after[:80]!r} in this response",
                           param="after") from None
        if page is None:
            raise _not_found(response_id)
        return JSONResponse({"object": "list", "data": page.items,
                             "first_id": page.items[0]["id"] if page.items else None,
                             "last_id": page.items[-1]["id"] if page.items else None,
                             "has_more": page.has_more})


def _refuse_query(request: Request, unsupported: tuple[str, ...]) -> None:
    for name in unsupported:
        value = request.query_params.get(name)
        if value not in (None, "", "false"):
            raise APIError(400, f"{name} is not supported by this server", param=name,
                           code="unsupported_parameter")


def _sse(event: dict[str, Any]) -> str:
    data = json.dumps(event, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n"


def _failure(chunk: dict[str, Any]) -> Response:
    """A plain request whose generation failed: the chat path's error, as it would say it."""
    err = chunk.get("error", chunk)
    status = 408 if err.get("code") == "request_timeout" else 500
    return APIError(status, str(err.get("message", "generation failed")),
                    err.get("type", "server_error"), err.get("param"),
                    err.get("code")).response()


__all__ = ["ResponsesServing"]
