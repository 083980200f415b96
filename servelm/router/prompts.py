"""A request's prompt as the replica will see it: token ids, for the router's cache estimate.

Owns: turning a completion or chat body into the token ids the replica's front end would
compute (the same schemas, chat template and tokenizer: servelm/server/prompts.py), or None
when that cannot be known here (no tokenizer for a text prompt, a body the replica will
refuse anyway). Never: refuses a request: the replica is the one that validates.
"""

from __future__ import annotations

from typing import Any


def prompt_token_ids(body: dict[str, Any], path: str, tokenizer) -> list[int] | None:
    try:
        if path.endswith("/chat/completions"):
            if tokenizer is None:
                return None
            from servelm.server.schemas import ChatCompletionRequest

            req = ChatCompletionRequest.model_validate(body)
            text = tokenizer.apply_chat_template(req.template_messages(),
                                                 add_generation_prompt=req.add_generation_prompt)
            return tokenizer.encode(text, add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # several prompts: place by the first
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and tokenizer is not None:
            return tokenizer.encode(prompt)
    except Exception:  # the replica will answer with the error; route it anyway
        return None
    return None


__all__ = ["prompt_token_ids"]
