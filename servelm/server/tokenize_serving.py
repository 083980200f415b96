"""`POST /tokenize` and `POST /detokenize`: the ids a request would be given, and back.

Owns: both routes' bodies and answers (the count, the ids and optionally their token strings;
the text of ids, special tokens kept), built with the same Prompts the generation endpoints
use, so /tokenize gives exactly the ids a completion or chat request would run with.
Never: runs the engine, or accepts an id outside the vocabulary (400 naming `tokens`).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from servelm.protocol import InvalidParameterError
from servelm.server.admission import Admission
from servelm.server.errors import APIError, read_json_object
from servelm.server.schemas import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest


class TokenizeServing:
    def __init__(self, admission: Admission):
        self.admission = admission
        self.prompts = admission.prompts
        self.state = admission.state

    async def tokenize(self, request: Request) -> Response:
        """{"count", "max_model_len", "tokens"[, "token_strs"]}: the ids a completion (prompt)
        or chat (messages, through the template) request would be given."""
        try:
            req = await self._small_request(request, TokenizeRequest)
            req.check()
            if req.prompt is not None:
                ids = await self.prompts.encode(req.prompt, req.add_special_tokens)
            else:
                chat = ChatCompletionRequest(messages=req.messages,
                                             add_generation_prompt=req.add_generation_prompt)
                (ids,), _ = await self.prompts.chat(chat)
        except InvalidParameterError as exc:
            raise APIError.from_invalid(exc) from None
        body: dict[str, Any] = {"count": len(ids), "tokens": ids,
                                "max_model_len": self.state.async_engine.max_model_len}
        if req.return_token_strs:
            body["token_strs"] = self.prompts.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        """{"prompt": text} of token ids (special tokens kept, as they were sent)."""
        tokenizer = self.prompts.tokenizer
        try:
            req = await self._small_request(request, DetokenizeRequest)
            if tokenizer is None:
                raise InvalidParameterError("this model has no tokenizer", param="tokens")
            vocab = self.prompts.vocab_size
            bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidParameterError(f"tokens: token id {bad} is outside the "
                                            f"vocabulary [0, {vocab})", param="tokens")
        except InvalidParameterError as exc:
            raise APIError.from_invalid(exc) from None
        return JSONResponse({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})

    async def _small_request(self, request: Request, schema):
        body = await read_json_object(request, self.state.config.max_body_bytes)
        return self.admission.validate(schema, body)
