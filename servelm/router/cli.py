"""`servelm router --replica URL [--replica URL ...] --policy NAME`: one endpoint in front of
several `servelm serve` replicas (docs/router.md).

Owns: the router's flags and its uvicorn server. Never: imports torch.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys

import uvicorn


class RouterServer(uvicorn.Server):
    """uvicorn, exiting with status 0 on SIGTERM/SIGINT (uvicorn re-raises the signal after
    its shutdown, so the process would end "killed by SIGTERM"); a second SIGINT forces."""

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def add_parser(subparsers) -> None:
    from servelm.router.policies import DEFAULT_POLICY, WORKER_POLICY, policy_help, policy_names

    p = subparsers.add_parser("router", help="OpenAI-compatible router over replicas",
                              description=__doc__.splitlines()[0])
    p.add_argument("--replica", action="append", default=None, metavar="URL",
                   help="a replica's base URL (repeat for each)")
    p.add_argument("--prefill", action="append", default=None, metavar="URL",
                   help="disaggregation: a `servelm serve --role prefill` worker (repeat; "
                        "with --decode, instead of --replica; docs/disaggregation.md)")
    p.add_argument("--decode", action="append", default=None, metavar="URL",
                   help="disaggregation: a `servelm serve --role decode` worker (repeat)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=policy_names(),
                   help=f"with --replica: {policy_help()}; with --prefill and --decode the "
                        f"workers are picked by {WORKER_POLICY}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--probe-interval", type=float, default=1.0,
                   help="seconds between health/metrics probes of each replica")
    p.add_argument("--eject-after", type=int, default=2,
                   help="consecutive failed probes or requests that take a replica out")
    p.add_argument("--replica-api-key", default=None,
                   help="bearer token for probing the replicas' /metrics (clients' own keys "
                        "are passed through unchanged)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--slo-spec", default=None, metavar="FILE",
                   help="the fleet's SLO classes (JSON, docs/slo.md): a request's priority / "
                        "slo_class is checked here and sent on as slo_class")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send an OpenTelemetry span per request to this OTLP/HTTP endpoint "
                        "and pass its context to the replica (needs servelm[otel]; without "
                        "it a client's traceparent header goes through unchanged)")
    p.add_argument("--model", default=None,
                   help="the replicas' model (name, .gguf or HF directory): its tokenizer turns "
                        "text prompts into the token ids prefix_affinity looks up (without "
                        "it only token-id prompts get a cache estimate)")
    p.set_defaults(func=handler)


def handler(args) -> int:
    if args.prefill or args.decode:
        return _disagg_handler(args)
    if not args.replica:
        print("servelm router: give --replica URL (or --prefill and --decode URLs)",
              file=sys.stderr)
        return 2
    from servelm.router.app import RouterConfig, build_router_app
    from servelm.router.policies import make_policy
    from servelm.router.replicas import ReplicaSet

    replicas = ReplicaSet(args.replica, args.probe_interval, args.eject_after,
                          api_key=args.replica_api_key)
    tokenizer = None
    if args.model:
        from servelm.loader import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(args.model))
    app = build_router_app(replicas, make_policy(args.policy),
                           RouterConfig(args.policy, args.request_timeout,
                                        otlp_traces_endpoint=args.otlp_traces_endpoint,
                                        slo_spec=args.slo_spec),
                           tokenizer)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    server = RouterServer(uvicorn.Config(app, log_level="warning", access_log=False))
    host, port = sock.getsockname()[:2]
    print(f"[servelm] router ({args.policy}) over {len(args.replica)} replicas at "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0


def _disagg_handler(args) -> int:
    from servelm.router.disagg import build_disagg_app

    if not (args.prefill and args.decode) or args.replica:
        print("servelm router: disaggregation takes --prefill and --decode URLs (and no "
              "--replica)", file=sys.stderr)
        return 2
    app = build_disagg_app(args.prefill, args.decode, args.probe_interval,
                           args.request_timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    print(f"[servelm] disaggregation router over {len(args.prefill)} prefill and "
          f"{len(args.decode)} decode workers at http://{host}:{port}/v1", file=sys.stderr,
          flush=True)
    RouterServer(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return 0
