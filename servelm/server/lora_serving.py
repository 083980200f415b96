"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`: adapters at run time.

Owns: the two routes' bodies (vLLM's: lora_name, lora_path; a missing, mistyped or unknown
field is a 400 naming it) and their answers; the engine's refusal (a bad adapter, no free
slot) as a 4xx, a dead engine as a 503.
Never: reads an adapter itself or decides where it lives (the engine's LoraSlots does), or
stops requests already running with an adapter being unloaded.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from servelm.engine.async_engine import EngineDeadError
from servelm.protocol import InvalidParameterError
from servelm.server.errors import APIError, read_json_object

logger = logging.getLogger(__name__)


class LoraServing:
    def __init__(self, state):
        self.state = state  # ServerState (app.py)

    async def load_lora_adapter(self, request: Request) -> Response:
        body = await read_json_object(request, self.state.config.max_body_bytes)
        name, path = _lora_fields(body, ("lora_name", "lora_path"))
        await _engine_call(self.state.async_engine.load_lora(name, path))
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await read_json_object(request, self.state.config.max_body_bytes)
        (name,) = _lora_fields(body, ("lora_name",), optional=("lora_int_id", "lora_path"))
        await _engine_call(self.state.async_engine.unload_lora(name))
        logger.info("LoRA adapter %r unloaded (requests using it run to their end)", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _engine_call(call) -> None:
    try:
        await call
    except InvalidParameterError as exc:
        raise APIError.from_invalid(exc) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "server_error", code="engine_unavailable") from None


def _lora_fields(body: dict[str, Any], required: tuple[str, ...],
                 optional: tuple[str, ...] = ()) -> list[str]:
    """The string fields of a load/unload body; a missing, mistyped or unknown field is a
    400 naming it."""
    for key in body:
        if key not in required and key not in optional and key != "load_inplace":
            raise APIError(400, f"unknown field {key!r}", param=key, code="unsupported_field")
    if body.get("load_inplace"):
        raise APIError(400, "load_inplace is not supported: unload the adapter, then load it",
                       param="load_inplace", code="unsupported_field")
    out = []
    for key in required:
        value = body.get(key)
        if not isinstance(value, str) or not value:
            raise APIError(400, f"{key} must be a non-empty string", param=key)
        out.append(value)
    return out
