"""`servelm bench multiturn`: conversations against an endpoint, the way chat users send them.

Owns: the multi-turn workload (conversations that share one system prompt, each turn's prompt
the whole history so far: system + user_1 + assistant_1 + ... + user_k), the session-driven
load (conversations start as a Poisson process; a conversation's next turn is sent a think
time after its previous reply ended, exponential around --think-time), the prefix-cache hit
rate from the servers' own counters, the balance across a router's replicas, and the JSON.
Never: starts or configures the server under test (benchmarks/cpu/run_router_policies.sh
starts one per routing policy).

The assistant turns in the history are seeded stand-in tokens, not the reply the server
generated: every system gets the very same requests, and only the previous *prompt* (not its
answer) is a cache hit, for every routing policy alike. Each conversation is sent with
`user: conv-<i>` so that a session-sticky router can keep it together.

Hit rate, from the servers' own counters (`servelm_prefix_cache_hit_tokens_total` over
`servelm_prompt_tokens_total`, the difference across the run): behind a servelm router the
router's per-replica copies of them (`servelm_router_replica_reported_*`), summed; against
one replica its own. The client's view (`usage.prompt_tokens_details.cached_tokens`) is
reported beside it. Imbalance is max / mean over replicas of the requests routed (and of the
prompt tokens they were sent) during the run: 1.0 is even.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from servelm.bench.loadgen import EndpointConfig, LoopLagSampler, make_client, stream_request
from servelm.bench.metrics import RequestRecord, build_serve_result, render_serve_table, \
    summarize
from servelm.bench.results import SCHEMA_VERSION, git_commit, machine_info
from servelm.bench.vocab import workload_vocab_size
from servelm.bench.workloads import (SPECIAL_MARGIN, RangeError, Request, check_vocab_size,
                                     parse_range)
from servelm.loader.model_cache import DEFAULT_MODEL

DEFAULT_RESULTS_DIR = Path("benchmarks/results")


@dataclass(frozen=True)
class Conversation:
    session: str
    turns: list[Request]  # turn k's prompt extends turn k-1's prompt


def multi_turn(num_conversations: int, system_len: int = 512,
               user_len: tuple[int, int] | str = (32, 128),
               output_len: tuple[int, int] | str = (32, 64),
               turns: tuple[int, int] | str = (3, 6), *, vocab_size: int,
               seed: int = 0, max_prompt_len: int = 4096) -> list[Conversation]:
    """Seeded conversations: one system prompt shared by all, uniform user/answer lengths and
    turn counts in the given inclusive ranges, ids from the model's vocabulary of
    `vocab_size`; a turn that would pass `max_prompt_len` ends its conversation."""
    if num_conversations < 1:
        raise RangeError(f"num_conversations must be >= 1, got {num_conversations}",
                         "num_conversations")
    if system_len < 0:
        raise RangeError(f"system_len must be >= 0, got {system_len}", "system_prompt_len")
    u_lo, u_hi = parse_range(user_len, "user_len")
    o_lo, o_hi = parse_range(output_len, "output_len")
    t_lo, t_hi = parse_range(turns, "turns")
    check_vocab_size(vocab_size)
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN,
                                             size=int(n))]

    system = ids(system_len)
    out = []
    for c in range(num_conversations):
        history, reqs = list(system), []
        for _ in range(int(rng.integers(t_lo, t_hi + 1))):
            prompt = history + ids(rng.integers(u_lo, u_hi + 1))
            if len(prompt) > max_prompt_len:
                break
            answer = int(rng.integers(o_lo, o_hi + 1))
            reqs.append(Request(prompt, answer))
            history = prompt + ids(answer)
        if reqs:
            out.append(Conversation(f"conv-{c}", reqs))
    return out


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    record: RequestRecord


async def _conversation(client, cfg: EndpointConfig, conv: Conversation, index: int,
                        start_at: float, think: np.ndarray, bar, out: list[TurnRecord]):
    delay = start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    session_cfg = dataclasses.replace(cfg, extra_body={**cfg.extra_body, "user": conv.session})
    for k, req in enumerate(conv.turns):
        if k:
            await asyncio.sleep(float(think[k]))
        rec = RequestRecord(len(req.prompt_token_ids), req.max_tokens,
                            scheduled_time=time.perf_counter())
        out.append(TurnRecord(index, k, rec))
        await stream_request(client, session_cfg, req, rec)
        bar.update(1)
        if not rec.is_ok:
            return  # a user whose turn failed does not go on with that history


async def run_conversations_async(cfg: EndpointConfig, conversations: Sequence[Conversation],
                                  rate: float, think_time_s: float, seed: int = 0,
                                  progress: bool = False) -> tuple[list[TurnRecord], float,
                                                                   list[float]]:
    """Drive the endpoint; (turn records, elapsed seconds, event-loop lags)."""
    from servelm.bench.loadgen import _progress

    rng = np.random.default_rng(seed + 1)
    starts = np.cumsum(rng.exponential(1.0 / rate, size=len(conversations)))
    starts -= starts[0]
    thinks = [rng.exponential(think_time_s, size=len(c.turns)) if think_time_s > 0
              else np.zeros(len(c.turns)) for c in conversations]
    records: list[TurnRecord] = []
    total = sum(len(c.turns) for c in conversations)
    async with make_client(cfg, max(1, len(conversations))) as client:
        lag = LoopLagSampler()
        lag.start()
        with _progress(total, progress) as bar:
            t0 = time.perf_counter()
            await asyncio.gather(*(
                _conversation(client, cfg, c, i, t0 + float(s), th, bar, records)
                for i, (c, s, th) in enumerate(zip(conversations, starts, thinks))))
            end = max([t0] + [t.record.end_time or time.perf_counter() for t in records])
        await lag.stop()
    return records, max(end - t0, 1e-9), lag.lags_s


_LABELLED = re.compile(r'^(servelm_[a-z_]+)\{replica="([^"]+)"\} (\S+)$', re.M)
_PLAIN = re.compile(r"^(servelm_[a-z_]+) (\S+)$", re.M)


def server_counters(cfg: EndpointConfig) -> dict[str, dict[str, float]]:
    """Per replica: {"hit_tokens", "prompt_tokens", "routed"} from the endpoint's /metrics:
    a servelm router's per-replica samples, or one server's own counters (replica "self");
    {} when the page has neither (another server)."""
    import httpx

    base = cfg.base_url.rstrip("/").removesuffix("/v1")
    try:
        text = httpx.get(base + "/metrics", headers=cfg.headers(), timeout=10.0,
                         trust_env=False).text
    except httpx.HTTPError:
        return {}
    names = {"servelm_router_replica_reported_hit_tokens": "hit_tokens",
             "servelm_router_replica_reported_prompt_tokens": "prompt_tokens",
             "servelm_router_requests_total": "routed"}
    out: dict[str, dict[str, float]] = {}
    for m in _LABELLED.finditer(text):
        if m.group(1) in names:
            out.setdefault(m.group(2), {})[names[m.group(1)]] = float(m.group(3))
    if out:
        return out
    plain = {m.group(1): float(m.group(2)) for m in _PLAIN.finditer(text)}
    if "servelm_prompt_tokens_total" not in plain:
        return {}
    return {"self": {"hit_tokens": plain.get("servelm_prefix_cache_hit_tokens_total", 0.0),
                     "prompt_tokens": plain["servelm_prompt_tokens_total"],
                     "routed": sum(float(line.split()[-1]) for line in text.splitlines()
                                   if line.startswith("servelm_requests_finished_total{"))}}


def _ratio(values: list[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean else None


def cache_and_balance(before: dict, after: dict) -> dict[str, Any]:
    """The run's prefix-cache hit rate and imbalance from two server_counters() snapshots."""
    per = {}
    for rep, a in after.items():
        b = before.get(rep, {})
        per[rep] = {k: a.get(k, 0.0) - b.get(k, 0.0)
                    for k in ("hit_tokens", "prompt_tokens", "routed")}
    hits = sum(p["hit_tokens"] for p in per.values())
    prompt = sum(p["prompt_tokens"] for p in per.values())
    return {"prefix_hit_rate": hits / prompt if prompt else None,
            "num_hit_tokens": hits, "num_prompt_tokens": prompt,
            "imbalance_requests": _ratio([p["routed"] for p in per.values()]),
            "imbalance_prompt_tokens": _ratio([p["prompt_tokens"] for p in per.values()]),
            "replicas": per}


def wait_counters_settled(cfg: EndpointConfig, num_prompt_tokens: int, timeout: float = 10.0):
    """The counters once the replicas' reports (a router probes them every fraction of a
    second) include every finished request, or as they are after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        now = server_counters(cfg)
        seen = sum(r.get("prompt_tokens", 0.0) for r in now.values())
        if seen >= num_prompt_tokens or time.monotonic() > deadline or not now:
            return now
        time.sleep(0.3)


def run_multiturn(args: argparse.Namespace) -> dict[str, Any]:
    convs = multi_turn(args.num_conversations, args.system_prompt_len, args.user_len,
                       args.output_len, args.turns, vocab_size=args.vocab_size,
                       seed=args.seed)
    cfg = EndpointConfig(args.base_url, args.model,
                         args.api_key or os.environ.get("OPENAI_API_KEY") or None,
                         timeout_s=args.timeout)
    before = server_counters(cfg)
    started = datetime.datetime.now(datetime.timezone.utc)
    turns, elapsed, lags = asyncio.run(run_conversations_async(
        cfg, convs, args.conversation_rate, args.think_time, args.seed, args.progress))
    records = [t.record for t in turns]
    base = sum(before.get(r, {}).get("prompt_tokens", 0.0) for r in before)
    sent = sum(r.usage_prompt_tokens or 0 for r in records if r.is_ok)
    after = wait_counters_settled(cfg, int(base + sent))
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3
    ok = [t for t in turns if t.record.is_ok]
    usage_cached = sum(t.record.cached_tokens or 0 for t in ok)
    usage_prompt = sum(t.record.usage_prompt_tokens or 0 for t in ok)
    result = {
        "schema_version": SCHEMA_VERSION, "kind": "multiturn", "system": args.label,
        "model": args.model, "base_url": args.base_url, "command": _command(),
        "machine": machine_info(), "commit": git_commit(),
        "started_at": started.isoformat(timespec="seconds"),
        "workload": {"num_conversations": len(convs),
                     "num_turns": sum(len(c.turns) for c in convs),
                     "system_prompt_len": args.system_prompt_len, "user_len": args.user_len,
                     "output_len": args.output_len, "turns": args.turns,
                     "conversation_rate": args.conversation_rate,
                     "think_time_s": args.think_time, "seed": args.seed,
                     "vocab_size": args.vocab_size,
                     "num_input_tokens": sum(len(r.prompt_token_ids) for c in convs
                                             for r in c.turns)},
        **build_serve_result(records, elapsed, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
                             loop_lag_s=lags),
        "ttft_ms_first_turn": summarize((t.record.ttft_s for t in ok if t.turn == 0), 1e3),
        "ttft_ms_later_turns": summarize((t.record.ttft_s for t in ok if t.turn > 0), 1e3),
        "usage_cached_tokens_rate": usage_cached / usage_prompt if usage_prompt else None,
        "server": cache_and_balance(before, after) if before and after else None,
    }
    return result


def _command() -> str:
    rest = sys.argv[1:]
    if rest and rest[0] == "bench":
        rest = rest[1:]
    return " ".join(["servelm", "bench"] + rest)


def render(result: dict[str, Any]) -> str:
    lines = [render_serve_table(result)]
    srv = result.get("server") or {}
    if srv.get("prefix_hit_rate") is not None:
        lines.append(f"prefix-cache hit rate (servers' counters): "
                     f"{srv['prefix_hit_rate']:.1%}")
    if result.get("usage_cached_tokens_rate") is not None:
        lines.append(f"cached tokens / prompt tokens (usage): "
                     f"{result['usage_cached_tokens_rate']:.1%}")
    if srv.get("imbalance_requests") is not None:
        lines.append(f"imbalance (max/mean): requests {srv['imbalance_requests']:.2f}, "
                     f"prompt tokens {srv['imbalance_prompt_tokens']:.2f}")
    return "\n".join(lines)


def cmd_multiturn(args: argparse.Namespace) -> int:
    try:
        for flag in ("conversation_rate", "timeout"):
            if not getattr(args, flag) > 0:
                raise RangeError(f"must be positive, got {getattr(args, flag)}", flag)
        if args.think_time < 0:
            raise RangeError(f"must be >= 0, got {args.think_time}", "think_time")
        args.vocab_size = workload_vocab_size(args.model, args.vocab_size)
        multi_turn(1, args.system_prompt_len, args.user_len, args.output_len, args.turns,
                   vocab_size=args.vocab_size)
    except RangeError as e:
        flag = "--" + e.param.replace("_", "-").lstrip("-")
        print(f"servelm bench multiturn: error: {flag}: {e}", file=sys.stderr)
        return 2
    result = run_multiturn(args)
    out = Path(args.out) if args.out else DEFAULT_RESULTS_DIR / (
        "multiturn-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))
    print(f"[bench multiturn] wrote {out}", file=sys.stderr)
    return 0 if result["num_completed"] else 1


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `multiturn` under `servelm bench` (called from servelm/bench/cli.py)."""
    p = bench_sub.add_parser("multiturn", help="multi-turn conversations with think time: "
                                                "prefix-cache hit rate, TTFT/TPOT, imbalance",
                             description=__doc__.splitlines()[0])
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--model", default=DEFAULT_MODEL, help="the `model` field sent")
    g.add_argument("--label", default=None, help="the system's name in the result")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g = p.add_argument_group("workload")
    g.add_argument("--num-conversations", type=int, default=32)
    g.add_argument("--system-prompt-len", type=int, default=512,
                   help="tokens of the system prompt every conversation shares")
    g.add_argument("--user-len", default="32:128", help="tokens per user turn, A or A:B")
    g.add_argument("--output-len", default="32:64", help="tokens per answer, A or A:B")
    g.add_argument("--turns", default="3:6", help="turns per conversation, A or A:B")
    g.add_argument("--conversation-rate", type=float, default=0.5,
                   help="new conversations per second (Poisson)")
    g.add_argument("--think-time", type=float, default=3.0,
                   help="mean seconds between a reply's end and the next turn (exponential)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn from [100, vocab-size - 100) (default: "
                        "--model's vocabulary, from its config)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=200.0)
    g.add_argument("--out", default=None,
                   help="result JSON (default benchmarks/results/multiturn-<UTC time>.json)")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=cmd_multiturn)
    return p


__all__ = ["Conversation", "cache_and_balance", "multi_turn", "run_conversations_async",
           "server_counters"]
