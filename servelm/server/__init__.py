"""OpenAI-compatible HTTP server: FastAPI app, SSE, errors, auth, Prometheus metrics.

`servelm serve MODEL` (serve/cli.py) builds an engine, wraps it in an AsyncEngine (its own
thread) and serves `build_app(engine, ServerConfig(...))` with uvicorn. See docs/server.md.
Never: runs model code on the event loop.
"""

__all__ = ["ServerConfig", "ServerState", "build_app"]


def __getattr__(name):
    # `servelm serve --help` imports server.server_config; keep FastAPI out of that path.
    if name in __all__:
        from servelm.server import app

        return getattr(app, name)
    raise AttributeError(name)
