"""One HTTP request's run through the engine: its engine requests, their deltas, their end.

Owns: Generation (the engine requests of one HTTP request, one per prompt with n choices
each: submitting them and waiting for admission, the per-request deadline, aborting when the
client goes, folding each delta into its choice, usage and the timing breakdowns), ClientGone,
and the two reductions over finished choices: best_of and summarize_timings.
Never: reads the HTTP request, formats a response (formatting.py does), or logs it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from servelm.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from servelm.protocol import EngineRequest, InvalidParameterError, SamplingParams, TokenDelta
from servelm.server.errors import APIError
from servelm.server.formatting import ChoiceState, finish_reason_name
from servelm.server.metrics import timing_breakdown

# Timing keys summed over prompts in a header summary; every other number is the worst
# (largest) prompt's.
_SUMMED_TIMING_KEYS = frozenset({"prompt_tokens", "completion_tokens", "num_preemptions",
                                 "num_cached_tokens"})


class ClientGone(Exception):
    """The HTTP client disconnected or stalled; the request was aborted."""


class Generation:
    """The engine requests of one HTTP request (one per prompt, each with n choices)."""

    def __init__(self, async_engine: AsyncEngine, base_id: str, prompts: list[list[int]],
                 params: SamplingParams, arrival: float, timeout_s: float | None,
                 client_param: Callable[[str | None], str | None] = lambda p: p,
                 lora_name: str | None = None, images: list | None = None):
        self.async_engine = async_engine
        self.client_param = client_param  # engine parameter name -> the field the client sent
        self.base_id = base_id
        self.n = params.n
        self.lora_name = lora_name  # a LoRA adapter every prompt runs with (None: the base)
        self.requests = [EngineRequest(f"{base_id}-{i}", ids, params, arrival_time=arrival,
                                       lora_name=lora_name, images=images or [])
                         for i, ids in enumerate(prompts)]
        self._prompt_index = {r.request_id: i for i, r in enumerate(self.requests)}
        self.arrival = arrival
        self.timeout_s = timeout_s
        self.deadline_hit = False
        self.stream: RequestStream | None = None
        self.timings: dict[str, Any] = {}  # request_id -> RequestTimings, when finished
        self.num_prompt_tokens = sum(len(ids) for ids in prompts)
        self.choices = [ChoiceState() for _ in range(len(prompts) * self.n)]
        self.status = "running"
        self.logged = False
        self._timer: asyncio.TimerHandle | None = None
        self.count_reasoning: Callable[[list[int]], int] | None = None

    @property
    def num_choices(self) -> int:
        return len(self.choices)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    async def start(self) -> None:
        """Submit and wait for admission; engine rejections raise APIError (4xx)."""
        loop = asyncio.get_running_loop()
        self.submitted = time.monotonic()  # arrival -> here: host work (request record)
        self.stream = self.async_engine.submit(self.requests)
        if self.timeout_s is not None:
            remaining = self.arrival + self.timeout_s - time.monotonic()
            self._timer = loop.call_later(max(0.0, remaining), self._on_deadline)
        try:
            await self.stream.admitted
        except InvalidParameterError as exc:
            self.close("rejected")
            exc.param = self.client_param(exc.param)
            raise APIError.from_invalid(exc) from None
        except EngineDeadError as exc:
            self.close("engine_dead")
            raise APIError(503, str(exc), "server_error", code="engine_unavailable") from None
        except BaseException:
            self.close("cancelled")
            raise

    def _on_deadline(self) -> None:
        self.deadline_hit = True
        for r in self.requests:
            self.async_engine.abort(r.request_id)

    def cancel(self, why: str) -> None:
        """The client went away: abort now and wake whoever waits on the stream."""
        if self.stream is not None and not self.stream.is_finished:
            self.close(why)
            self.stream.fail(ClientGone(why))

    def close(self, status: str | None = None) -> None:
        if status is not None and self.status == "running":
            self.status = status
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.stream is not None:
            self.async_engine.release(self.stream)

    def index_of(self, d: TokenDelta) -> int:
        return self._prompt_index[d.request_id] * self.n + d.index

    def apply(self, d: TokenDelta) -> tuple[int, str | None]:
        """Fold a delta into its choice; (choice index, mapped finish reason or None)."""
        i = self.index_of(d)
        c = self.choices[i]
        c.text += d.text
        c.token_ids += d.token_ids
        if d.logprobs:
            c.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            c.prompt_logprobs = d.prompt_logprobs
        if d.embedding is not None:
            c.embedding = d.embedding
        c.num_prompt_tokens = d.num_prompt_tokens or c.num_prompt_tokens
        if d.timings is not None:
            self.timings[d.request_id] = d.timings
        reason = finish_reason_name(d.finish_reason, self.deadline_hit)
        if reason is not None:
            c.finish_reason = reason
        if d.error:
            raise RuntimeError(d.error)
        return i, reason

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage, with the prompt tokens the prefix cache held
        (`prompt_tokens_details.cached_tokens`, as OpenAI reports its prompt caching) and
        the completion tokens spent thinking (`completion_tokens_details.reasoning_tokens`,
        counted when a reasoning parser reads the output; they are part of
        completion_tokens, as max_tokens counts them)."""
        p, c = self.num_prompt_tokens, self.num_completion_tokens
        cached = sum(t.num_cached_tokens for t in self.timings.values())
        reasoning = self.num_reasoning_tokens()
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": min(cached, p)},
                "completion_tokens_details": {"reasoning_tokens": reasoning}}

    def num_reasoning_tokens(self) -> int:
        """Completion tokens spent thinking, every choice's."""
        if self.count_reasoning is None:
            return 0
        return sum(self.count_reasoning(ch.token_ids) for ch in self.choices)

    def timing(self) -> Any:
        """One breakdown per prompt (a dict when there is one prompt)."""
        out = self._timings()
        return out[0] if len(out) == 1 else out

    def timing_summary(self) -> dict[str, Any]:
        """The breakdown for a header: one prompt's, or a summary of all of them whose size
        does not depend on the number of prompts (the per-prompt detail is in the log)."""
        return summarize_timings(self._timings())

    def _timings(self) -> list[dict[str, Any]]:
        out = []
        for i, r in enumerate(self.requests):
            completion = sum(len(c.token_ids) for c in self.choices[i * self.n:(i + 1) * self.n])
            out.append(timing_breakdown(self.timings.get(r.request_id),
                                        len(r.prompt_token_ids), completion))
        return out

    def timeout_error(self) -> APIError:
        return APIError(408, f"request timed out after {self.timeout_s:g}s before any token "
                        "was generated", "timeout_error", param="timeout",
                        code="request_timeout")


def best_of(choices: list[ChoiceState], num_candidates: int, n: int,
            keep_logprobs: bool) -> list[ChoiceState]:
    """Per prompt, the n candidates whose tokens have the highest total logprob (OpenAI's
    best_of), in that order."""
    out = []
    for start in range(0, len(choices), num_candidates):
        group = choices[start:start + num_candidates]
        ranked = sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs))
        for c in ranked[:n]:
            if not keep_logprobs:
                c.logprobs = []
            out.append(c)
    return out


def summarize_timings(timings: list[dict[str, Any]]) -> dict[str, Any]:
    """One prompt's breakdown as it is; for several, the same keys with counts summed and
    times (seconds) the largest over prompts, plus `num_prompts`: a fixed size whatever the
    number of prompts."""
    if len(timings) == 1:
        return timings[0]
    out: dict[str, Any] = {"num_prompts": len(timings)}
    for key in dict.fromkeys(k for t in timings for k in t):
        values = [t[key] for t in timings if t.get(key) is not None]
        if not values:
            out[key] = None
        elif key in _SUMMED_TIMING_KEYS:
            out[key] = sum(values)
        else:
            out[key] = max(values)
    return out
