"""`servelm doctor`: rank the causes of a latency tail, from a live server or a request log.

  servelm doctor --url http://127.0.0.1:8000 [--api-key KEY] [--window 300]
  servelm doctor --log requests.jsonl          (written by `servelm serve --request-log FILE`)

Owns: fetching the window's request records (GET /dashboard/data?records=1) or reading them
from a JSON-lines log, and printing servelm.doctor.diagnose's ranking (or --json).
Never: changes the server it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from servelm.doctor import METRICS, DoctorInputError, diagnose
from servelm.server.dashboard.records import RequestRecord, read_log


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor", help="rank the causes of a TTFT / latency tail (queueing, long prefill, "
        "preemption, prefix-cache misses, host stalls, slow clients)",
        description="Reads a window of per-request records and ranks the suspects for a tail "
                    "that moved while the median did not, each with its evidence "
                    "(docs/observability.md).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running `servelm serve` (its /dashboard/data)")
    src.add_argument("--log", help="a JSON-lines request log (`servelm serve --request-log`)")
    p.add_argument("--api-key", default=os.environ.get("SERVELM_API_KEY"),
                   help="the server's API key (default: $SERVELM_API_KEY)")
    p.add_argument("--window", type=float, default=300.0,
                   help="seconds of recent requests to read from --url (default 300)")
    p.add_argument("--metric", default="ttft", choices=METRICS,
                   help="the latency whose tail regressed (default ttft)")
    p.add_argument("--quantile", type=float, default=0.99, help="the tail (default 0.99)")
    p.add_argument("--min-tail", type=int, default=5,
                   help="at least this many requests in the tail (default 5)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engine's chunk budget, when the records do not carry it")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(func=handler)
    return p


def fetch_records(url: str, api_key: str | None, window: float) -> list[RequestRecord]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/dashboard/data",
                      params={"records": 1, "window": window}, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise DoctorInputError(f"--url: cannot reach {url}: {exc}") from None
    if r.status_code == 401:
        raise DoctorInputError("--api-key: the server refused the key (401)")
    if r.status_code != 200:
        raise DoctorInputError(f"--url: {url}/dashboard/data answered {r.status_code}: "
                               f"{r.text[:200]}")
    data = r.json()
    if "records" not in data:
        raise DoctorInputError(f"--url: {url} is not a servelm server with request records "
                               "(a router? point the doctor at one replica)")
    records = []
    for d in data["records"]:
        d = {k: v for k, v in d.items() if k != "arrival_ago_s"}
        records.append(RequestRecord.from_dict(d))
    if data.get("max_num_batched_tokens"):
        for rec in records:
            rec.max_num_batched_tokens = rec.max_num_batched_tokens or \
                data["max_num_batched_tokens"]
    return records


def load_records(args) -> list[RequestRecord]:
    if args.url:
        return fetch_records(args.url, args.api_key, args.window)
    try:
        with open(args.log, encoding="utf-8") as f:
            records, _ = read_log(f)
    except OSError as exc:
        raise DoctorInputError(f"--log: cannot read {args.log}: {exc.strerror}") from None
    except ValueError as exc:
        raise DoctorInputError(f"--log: {args.log}: {exc}") from None
    return records


def handler(args: argparse.Namespace) -> int:
    try:
        if args.window <= 0:
            raise DoctorInputError(f"--window must be positive, got {args.window}")
        records = load_records(args)
        result = diagnose(records, args.metric, args.quantile, args.min_tail,
                          args.max_num_batched_tokens)
    except DoctorInputError as exc:
        print(f"servelm doctor: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.render())
    return 0
