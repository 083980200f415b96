"""A request's prompts as token ids: tokenizing, the chat template, tools and images.

Owns: Prompts (a completion's prompts, strings or ids; a chat's messages through the model's
chat template, the tools rendered into it and each image's placeholder expanded to its
tokens; long texts tokenized on a worker thread) and tool_parser, the parser a tool-choice
mode reads the output with (the template needs it too).
Never: decides whether a request is admitted (admission.py), or blocks the event loop on a
long prompt or an image.
"""

from __future__ import annotations

import asyncio

from servelm.parsers import get_tool_parser
from servelm.parsers.tool_parsers import JsonToolParser
from servelm.parsers.tool_prompt import tool_prompt
from servelm.protocol import InvalidParameterError
from servelm.server.schemas import ChatCompletionRequest, CompletionRequest
from servelm.vision.pipeline import ImagePipeline, image_limits, vision_of

# Prompts longer than this many characters are tokenized off the event loop.
_TOKENIZE_INLINE_CHARS = 16_384


def tool_parser(tool_call_parser: str | None, mode: str):
    """required / named choices are constrained to JSON calls (ChatCompletionRequest
    .structured); auto reads the model's own format (the server's --tool-call-parser)."""
    if mode in ("required", "named"):
        return JsonToolParser()
    return get_tool_parser(tool_call_parser)


class Prompts:
    """The token ids of requests to the engine that `state` (ServerState, app.py) serves."""

    def __init__(self, state):
        self.state = state

    @property
    def tokenizer(self):
        return self.state.async_engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.state.async_engine.vocab_size

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise InvalidParameterError("this model has no tokenizer; send token ids",
                                        param="prompt")
        if len(text) > _TOKENIZE_INLINE_CHARS:
            return await asyncio.to_thread(tok.encode, text, add_special_tokens)
        return tok.encode(text, add_special_tokens)

    async def completion(self, req: CompletionRequest):
        """(ids per prompt, text per prompt: None where it was sent as ids and not echoed)."""
        ids_list, texts = [], []
        for p in req.prompts():
            if isinstance(p, str):
                ids = await self.encode(p)
                texts.append(p)
            else:
                ids = list(p)
                texts.append(self._decode(ids) if req.echo else None)
            if not ids:
                raise InvalidParameterError("prompt must not be empty", param="prompt")
            ids_list.append(ids)
        return ids_list, texts

    def _decode(self, ids: list[int]) -> str | None:
        vocab = self.vocab_size
        if self.tokenizer is None or any(not 0 <= t < vocab for t in ids):
            return None  # the engine rejects bad ids with a clear error
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    async def chat(self, req: ChatCompletionRequest, images_out: list | None = None):
        """The chat prompt's ids; with image parts, each image's placeholder expanded to its
        tokens and its ImageInput appended to images_out (servelm/vision/)."""
        vision = vision_of(self.state.async_engine)
        parts: list = []
        messages = req.template_messages(parts, vision.image_prompt if vision else None)
        tok = self.tokenizer
        if tok is None:
            raise InvalidParameterError("this model has no tokenizer", param="messages")
        mode, _ = req.tool_mode()
        tools = [t.to_template() for t in req.tools] if req.tools and mode != "none" else None
        messages, extra = tool_prompt(tok.chat_template, messages, tools,
                                      tool_parser(self.state.config.tool_call_parser, mode))
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=
                                           req.add_generation_prompt, **extra)
        except InvalidParameterError:
            raise
        except Exception as exc:  # a template error is about these messages
            raise InvalidParameterError(f"cannot apply the chat template: {exc}",
                                        param="messages") from None
        ids = await self.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidParameterError("messages render to an empty prompt", param="messages")
        if parts:
            ids, inputs = await self._images(vision).prepare(ids, parts)
            if images_out is not None:
                images_out += inputs
        return [ids], [None]

    def _images(self, vision):
        """The image pipeline (decode, limits, preprocessing in worker threads), made once."""
        pipeline = getattr(self.state, "image_pipeline", None)
        if pipeline is None:
            pipeline = self.state.image_pipeline = ImagePipeline(vision,
                                                                 image_limits(self.state.config))
        return pipeline
