"""OpenAI request schemas (pydantic) for /v1/completions and /v1/chat/completions.

Owns: the shape and types of request bodies, and their conversion into SamplingParams.
Never: range checks that SamplingParams already makes (one place decides what is valid; its
InvalidParameterError names the parameter), or anything that needs the model.
Unknown fields are ignored, as vLLM and SGLang do, so clients sending newer fields still work;
an OpenAI field servelm knows and does not implement is a 400 naming it (`check_known_fields`),
never silently dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from servelm.protocol import InvalidParameterError, SamplingParams, StructuredOutput
from servelm.vision.parts import image_part

# OpenAI's limit on stop sequences (SamplingParams allows more for the Python API, and checks
# their length).
MAX_STOP_STRINGS = 4

# The roles a chat template may see (OpenAI's, `function` being its deprecated `tool`); every
# one but the assistant's (which may carry only tool calls) must have content.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_ROLES_WITHOUT_CONTENT = frozenset({"assistant"})

# A JSON number, not a bool or a numeric string (pydantic's lax float takes both).
Number = Union[StrictInt, StrictFloat]


# OpenAI request fields servelm does not implement, with the values that ask for nothing
# (sent by clients that fill in defaults); any other value is a 400 naming the field.
_NOT_IMPLEMENTED: dict[str, tuple] = {
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None,),  # the deprecated form of `tools`
    "function_call": (None, "none", "auto"),
    "verbosity": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
}
_NOT_IMPLEMENTED_WHY = {
    "functions": "send `tools` instead", "function_call": "send `tool_choice` instead",
    "store": "servelm does not store completions",
}


def check_known_fields(body: dict[str, Any]) -> None:
    """A 400 for an OpenAI field servelm knows but does not implement, unless it asks for
    nothing."""
    for name, neutral in _NOT_IMPLEMENTED.items():
        if name in body and body[name] not in neutral:
            why = _NOT_IMPLEMENTED_WHY.get(name)
            raise InvalidParameterError(
                f"{name} is not supported by this server" + (f" ({why})" if why else ""),
                param=name, code="unsupported_parameter")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    n: StrictInt = 1
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # extensions (vLLM / SGLang names)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    cache_salt: StrictStr | None = None
    # OpenAI's routing hint for requests sharing a prefix: a router in front of replicas
    # sends them to one replica (servelm router's prefix_affinity); a replica ignores it.
    prompt_cache_key: StrictStr | None = None
    # OpenAI's "in_memory" (the default) or "24h": the prompt's prefix-cache blocks are
    # evicted after others' for that long (capped per cache namespace by a serve flag).
    prompt_cache_retention: StrictStr | None = None
    skip_special_tokens: StrictBool = True
    speculative: StrictBool = True  # false: this request never speculates
    # The request's SLO class (servelm/slo.py): by priority (vLLM's field; the class with
    # that priority) or by name; neither: the spec's default class.
    priority: StrictInt | None = None
    slo_class: StrictStr | None = None
    # OpenAI's structured outputs, and servelm's extension (vLLM's name):
    # {"json": schema} | {"regex": str} | {"choice": [str, ...]} | {"grammar": str}
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[StrictStr, Number] | None = None  # OpenAI: token id (as text) -> bias
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None

    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def _prompt_logprobs(self) -> int | None:
        return None

    def sampling_params(self, max_n: int, tokenize_words=None) -> SamplingParams:
        """Raises InvalidParameterError naming the parameter. `tokenize_words(words)` gives
        the token-id sequences of `bad_words`."""
        if self.n > max_n:
            raise InvalidParameterError(f"n must be at most {max_n}, got {self.n}", param="n")
        if self.num_candidates > max_n:
            raise InvalidParameterError(f"best_of must be at most {max_n}, got "
                                        f"{self.num_candidates}", param="best_of")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidParameterError(
                f"stop has {len(stop)} sequences; at most {MAX_STOP_STRINGS} are allowed",
                param="stop")
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError("stream_options is only allowed when stream is true",
                                        param="stream_options")
        kwargs: dict[str, Any] = dict(
            n=self.num_candidates, max_tokens=self._max_tokens(), min_tokens=self.min_tokens,
            stop=stop, stop_token_ids=self.stop_token_ids or [], seed=self.seed,
            ignore_eos=self.ignore_eos, logprobs=self._num_logprobs(),
            skip_special_tokens=self.skip_special_tokens, cache_salt=self.cache_salt,
            speculative=self.speculative, structured=self.structured(),
            logit_bias=self._logit_bias(), allowed_token_ids=self.allowed_token_ids,
            prompt_logprobs=self._prompt_logprobs(),
            prompt_cache_retention=self.prompt_cache_retention)
        if self.bad_words:
            if any(not w.strip() for w in self.bad_words):
                raise InvalidParameterError("bad_words entries must be non-empty",
                                            param="bad_words")
            if tokenize_words is None:
                raise InvalidParameterError("bad_words needs a tokenizer", param="bad_words")
            kwargs["bad_words_token_ids"] = tokenize_words(self.bad_words)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.top_k is not None:
            kwargs["top_k"] = -1 if self.top_k == 0 else self.top_k
        return SamplingParams(**kwargs)

    def _logit_bias(self) -> dict[int, float]:
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidParameterError(f"logit_bias keys must be token ids, got "
                                            f"{key[:32]!r}", param="logit_bias") from None
            out[token_id] = float(value)
        return out

    def structured(self) -> StructuredOutput | None:
        """The output constraint of `response_format` or `structured_outputs` (not both)."""
        fmt = _response_format(self.response_format)
        ext = _structured_outputs(self.structured_outputs)
        if fmt is not None and ext is not None:
            raise InvalidParameterError("structured_outputs cannot be combined with a "
                                        "response_format other than text",
                                        param="structured_outputs")
        return fmt or ext

    @property
    def num_candidates(self) -> int:
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def client_param(self, param: str | None) -> str | None:
        """The request field the client sent for an engine-side parameter name."""
        return param

    def num_prompts(self) -> int:
        return 1

    def check_size(self, max_prompts: int, max_choices: int) -> None:
        """Prompts per request and choices (n x prompts) within the server's limits; checked
        before anything is tokenized."""
        num_prompts = self.num_prompts()
        if num_prompts > max_prompts:
            raise InvalidParameterError(
                f"prompt has {num_prompts} prompts; at most {max_prompts} are allowed per "
                "request", param="prompt", code="too_many_prompts")
        n, param = self.n, "n"
        if self.num_candidates > n:
            n, param = self.num_candidates, "best_of"
        if n * num_prompts > max_choices:
            raise InvalidParameterError(
                f"{param} x prompts is {n} x {num_prompts} = {n * num_prompts} choices; at "
                f"most {max_choices} are allowed per request", param=param,
                code="too_many_choices")


Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None  # echo with logprobs scores the prompt

    def _num_logprobs(self) -> int | None:
        if self.logprobs is None and self.num_candidates > self.n:
            return 0  # best_of ranks candidates by their tokens' logprobs
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids. Raises on an empty prompt."""
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif not p:
            raise InvalidParameterError("prompt must not be empty", param="prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        for item in items:
            if len(item) == 0:
                raise InvalidParameterError("prompt must not be empty", param="prompt")
        return items

    def num_prompts(self) -> int:
        return len(self.prompts())

    @property
    def num_candidates(self) -> int:
        """Choices generated per prompt: best_of of them, the n most likely returned."""
        return self.best_of if self.best_of is not None else self.n

    def check_unsupported(self) -> None:
        if self.suffix:
            raise InvalidParameterError("suffix is not supported", param="suffix")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise InvalidParameterError(f"best_of ({self.best_of}) must be at least n "
                                            f"({self.n})", param="best_of")
            if self.stream and self.best_of > self.n:
                raise InvalidParameterError("best_of cannot be used with stream",
                                            param="best_of")


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr = "function"
    function: FunctionSpec

    def to_template(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.function.name,
                              "parameters": self.function.parameters or {"type": "object",
                                                                         "properties": {}}}
        if self.function.description is not None:
            fn["description"] = self.function.description
        return {"type": "function", "function": fn}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers

    def to_template(self, i: int, images: list | None = None,
                    image_prompt: str | None = None) -> dict[str, Any]:
        """{'role', 'content': str}, text parts joined; other part types, unknown roles and
        missing content are rejected. image_url parts become `image_prompt` (the model's
        image text) and are appended to `images` (servelm/vision/parts.py)."""
        if self.role not in CHAT_ROLES:
            raise InvalidParameterError(
                f"messages[{i}].role: unknown role {self.role[:64]!r} (expected one of: "
                f"{', '.join(sorted(CHAT_ROLES))})", param="messages")
        if self.content is None and self.role not in _ROLES_WITHOUT_CONTENT:
            raise InvalidParameterError(f"messages[{i}]: a {self.role} message needs content",
                                        param="messages")
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") == "image_url" and images is not None:
                    texts.append(image_part(part, f"messages[{i}].content[{j}]",
                                            image_prompt, images))
                    continue
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidParameterError(
                        f"messages[{i}].content: only text parts are supported",
                        param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(self.tool_calls)]
        return msg


def _template_call(i: int, j: int, call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool call as chat templates read it: arguments as an object."""
    fn = call.get("function")
    where = f"messages[{i}].tool_calls[{j}]"
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidParameterError(f"{where} needs function.name", param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise InvalidParameterError(f"{where}.function.arguments is not JSON",
                                        param="messages") from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list[ToolSpec] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    # A cap on the thinking (servelm/server/reasoning_budget.py): in tokens (vLLM's name),
    # or OpenAI's effort mapped to tokens; the engine closes the block when it is spent.
    thinking_token_budget: StrictInt | None = None
    reasoning_effort: StrictStr | None = None

    def _max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def _num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs needs logprobs to be true",
                                        param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def client_param(self, param: str | None) -> str | None:
        if param == "prompt":
            return "messages"
        if param == "logprobs" and self.top_logprobs is not None:
            return "top_logprobs"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return param

    def template_messages(self, images: list | None = None,
                          image_prompt: str | None = None) -> list[dict[str, Any]]:
        """images: collects the image_url parts (None: refuse them as non-text parts)."""
        if not self.messages:
            raise InvalidParameterError("messages must be a non-empty list", param="messages")
        return [m.to_template(i, images, image_prompt) for i, m in enumerate(self.messages)]

    def check_unsupported(self) -> None:
        self.tool_mode()

    def tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function), validated."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise InvalidParameterError("tool_choice needs tools", param="tool_choice")
            return "none", None
        names = [t.function.name for t in self.tools]
        for t in self.tools:
            if t.type != "function":
                raise InvalidParameterError(f"tools: only function tools are supported, got "
                                            f"{t.type[:32]!r}", param="tools")
            if not _TOOL_NAME.match(t.function.name):
                raise InvalidParameterError(
                    f"tools: function name {t.function.name[:80]!r} must be 1-64 letters, "
                    "digits, _ or -", param="tools")
        if len(set(names)) != len(names):
            raise InvalidParameterError("tools: function names must be unique", param="tools")
        if choice is None:
            return "auto", None
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise InvalidParameterError(
                    f"tool_choice must be none, auto, required or a function, got "
                    f"{choice[:32]!r}", param="tool_choice")
            return choice, None
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidParameterError('tool_choice must be {"type": "function", '
                                        '"function": {"name": ...}}', param="tool_choice")
        if name not in names:
            raise InvalidParameterError(f"tool_choice names {name[:64]!r}, which is not in "
                                        "tools", param="tool_choice")
        return "named", name

    def structured(self) -> StructuredOutput | None:
        """tool_choice required / named: the output is constrained to call JSON (so the
        arguments always parse); otherwise response_format / structured_outputs."""
        mode, name = self.tool_mode()
        if mode not in ("required", "named"):
            return super().structured()
        if super().structured() is not None:
            raise InvalidParameterError(f"tool_choice {mode} cannot be combined with "
                                        "response_format or structured_outputs",
                                        param="tool_choice")
        tools = [t for t in self.tools if mode == "required" or t.function.name == name]
        calls = [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": t.function.parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1
                                  else {"anyOf": calls}, "minItems": 1}
        if mode == "named" or not self.parallel_tool_calls:
            schema["maxItems"] = 1
        strict = all(t.function.strict for t in tools)
        return StructuredOutput("json_schema", json.dumps(schema), strict=strict,
                                param="tool_choice")


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: the pooled final hidden state of each input (docs/server.md)."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    input: Prompt
    encoding_format: StrictStr = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    pooling: StrictStr = "mean"  # servelm extension: "mean" | "last"

    # what the generation path reads of a completion request
    n: ClassVar[int] = 1
    num_candidates: ClassVar[int] = 1
    stream: ClassVar[bool] = False
    include_usage: ClassVar[bool] = False
    echo: ClassVar[bool] = False
    logprobs: ClassVar[None] = None

    def prompts(self) -> list[str | list[int]]:
        return CompletionRequest.prompts(self._as_completion())

    def _as_completion(self) -> CompletionRequest:
        return CompletionRequest.model_construct(prompt=self.input)

    def num_prompts(self) -> int:
        return len(self.prompts())

    def check_size(self, max_prompts: int, max_choices: int) -> None:
        self._as_completion().check_size(max_prompts, max_choices)

    def client_param(self, param: str | None) -> str | None:
        return "input" if param in ("prompt", "max_tokens") else param

    def check_unsupported(self) -> None:
        if self.encoding_format not in ("float", "base64"):
            raise InvalidParameterError("encoding_format must be float or base64",
                                        param="encoding_format")

    def check_dimensions(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise InvalidParameterError(
                f"dimensions: this model's embeddings have {hidden_size} dimensions; "
                f"shortening them is not supported", param="dimensions")

    def sampling_params(self, max_n: int, tokenize_words=None) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=0.0, pooling=self.pooling,
                              speculative=False)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages through the template."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True  # prompt only (a chat template places its own)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidParameterError("send exactly one of prompt and messages",
                                        param="prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: list[StrictInt]


def _response_format(fmt: dict[str, Any] | None) -> StructuredOutput | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_schema", '{"type": "object"}')
    if kind != "json_schema":
        raise InvalidParameterError(
            f"response_format.type must be one of text, json_object, json_schema; got "
            f"{str(kind)[:64]!r}", param="response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise InvalidParameterError("response_format.json_schema must be an object with a "
                                    "`schema` object", param="response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidParameterError("response_format.json_schema.strict must be a boolean",
                                    param="response_format")
    schema = spec.get("schema", {})  # OpenAI: a missing schema is any JSON
    return StructuredOutput("json_schema", json.dumps(schema), strict=bool(strict))


_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                     "grammar": "grammar"}


def _structured_outputs(ext: dict[str, Any] | None) -> StructuredOutput | None:
    if ext is None:
        return None
    given = [k for k in _STRUCTURED_KINDS if ext.get(k) is not None]
    if len(given) != 1:
        raise InvalidParameterError(
            f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KINDS)}; got "
            f"{', '.join(given) or 'none'}", param="structured_outputs")
    key = given[0]
    value = ext[key]
    param = "structured_outputs"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidParameterError(f"structured_outputs.json is not JSON: {exc}",
                                            param=param) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidParameterError("structured_outputs.json must be a JSON schema",
                                        param=param)
        return StructuredOutput("json_schema", json.dumps(value), strict=True, param=param)
    if key == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise InvalidParameterError("structured_outputs.choice must be a non-empty list "
                                        "of non-empty strings", param=param)
        return StructuredOutput("choice", json.dumps(value), param=param)
    if not isinstance(value, str) or not value:
        raise InvalidParameterError(f"structured_outputs.{key} must be a non-empty string",
                                    param=param)
    return StructuredOutput(_STRUCTURED_KINDS[key], value, param=param)


__all__ = ["check_known_fields", "DetokenizeRequest", "EmbeddingRequest", "TokenizeRequest", "CHAT_ROLES", "MAX_STOP_STRINGS", "ChatCompletionRequest", "ChatMessage",
           "CompletionRequest", "StreamOptions"]
