"""Behaviour evals against a running OpenAI-compatible server (`servelm serve`).

Greedy agreement: each chat prompt of data/agreement_prompts.json answered greedily (at most
32 tokens, stopping at the end of the turn) by the server under test and by a reference
(the unquantized model); a prompt agrees when the two token sequences are the same.
Perplexity averages over every token; agreement sees the one flip that sends an answer
somewhere else.

Exact match: data/exact_match.json, few-shot "Q: ...\\nA:" completions, greedy, stopped at a
newline, compared after normalisation (lower case; punctuation, articles and spaces removed)
with the accepted answers.

Requests go out a few at a time so the server batches them; servelm's greedy output does not
depend on the batch (up to floating-point ties, docs/quantization.md "Quality").
"""

from __future__ import annotations

import json
import re
import string
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from servelm.evals import DATA_DIR

AGREEMENT_TOKENS = 32


def load_agreement_prompts() -> list[str]:
    return json.loads((DATA_DIR / "agreement_prompts.json").read_text())["prompts"]


def load_exact_match() -> tuple[str, list[dict]]:
    data = json.loads((DATA_DIR / "exact_match.json").read_text())
    return data["fewshot"], data["items"]


def _post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def _map(fn, items, concurrency: int) -> list:
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(fn, items))


def greedy_chat_tokens(base_url: str, model: str, prompts: list[str],
                       max_tokens: int = AGREEMENT_TOKENS, concurrency: int = 8,
                       api_key: str | None = None) -> list[list[str]]:
    """The greedy answer to each prompt as its list of tokens (logprobs' token strings)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url, timeout=600, headers=headers) as client:
        def one(prompt: str) -> list[str]:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "temperature": 0, "logprobs": True}
            choice = _post(client, "/v1/chat/completions", body)["choices"][0]
            return [t["token"] for t in choice["logprobs"]["content"]]

        return _map(one, prompts, concurrency)


class AgreementResult(NamedTuple):
    num_agree: int
    num_prompts: int
    share: float
    first_divergence: list[int | None]  # per prompt: first differing token, None if equal


def agreement(reference: list[list[str]], candidate: list[list[str]]) -> AgreementResult:
    if len(reference) != len(candidate):
        raise ValueError(f"reference has {len(reference)} answers, candidate "
                         f"{len(candidate)}")
    firsts: list[int | None] = []
    for ref, cand in zip(reference, candidate):
        if ref == cand:
            firsts.append(None)
            continue
        firsts.append(next((i for i, (a, b) in enumerate(zip(ref, cand)) if a != b),
                           min(len(ref), len(cand))))
    num_agree = sum(f is None for f in firsts)
    return AgreementResult(num_agree, len(reference), num_agree / max(1, len(reference)),
                           firsts)


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style: lower case, no punctuation, no articles, no whitespace."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return "".join(text.split())


class ExactMatchResult(NamedTuple):
    num_correct: int
    num_items: int
    score: float
    answers: list[str]  # the model's raw answers, in item order


def exact_match(base_url: str, model: str, fewshot: str | None = None,
                items: list[dict] | None = None, concurrency: int = 8,
                api_key: str | None = None) -> ExactMatchResult:
    import httpx

    if items is None:
        fewshot, items = load_exact_match()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url, timeout=600, headers=headers) as client:
        def one(item: dict) -> str:
            body = {"model": model, "prompt": f"{fewshot}Q: {item['question']}\nA:",
                    "max_tokens": 16, "temperature": 0, "stop": ["\n"]}
            return _post(client, "/v1/completions", body)["choices"][0]["text"]

        answers = _map(one, items, concurrency)
    correct = sum(normalize_answer(a) in {normalize_answer(x) for x in item["answers"]}
                  for a, item in zip(answers, items))
    return ExactMatchResult(correct, len(items), correct / max(1, len(items)), answers)
