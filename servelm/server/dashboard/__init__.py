"""The live dashboard of one server (or of the router's fleet): `GET /dashboard`.

Owns: the routes (an APIRouter the app includes): `/dashboard` (one self-contained HTML page,
shipped in this package; no CDN), `/dashboard/dashboard.js`, and `/dashboard/data` (the JSON the
page polls, servelm/server/dashboard/data.py), plus the Grafana dashboard JSON for the same
panels over Prometheus (`grafana.json`).
The page and its script hold no data and no secret, so they are public (a browser cannot put
an Authorization header on a navigation); `/dashboard/data` is behind the API key like every
other route, and the page sends the key it is given in the URL fragment (`#key=...`, never
sent to the server or written to its logs) or typed into its form.
Never: computes a number `/metrics` does not also export from the same source.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from servelm.server.dashboard.data import dashboard_data, parse_window

PUBLIC_PATHS = frozenset({"/dashboard", "/dashboard/dashboard.js"})


def asset(name: str) -> bytes:
    """A file shipped with the package (index.html, dashboard.js, grafana.json)."""
    return resources.files(__package__).joinpath(name).read_bytes()


def page_routes(router: APIRouter) -> None:
    @router.get("/dashboard")
    async def page() -> Response:
        return Response(asset("index.html"), media_type="text/html; charset=utf-8",
                        headers={"cache-control": "no-cache"})

    @router.get("/dashboard/dashboard.js")
    async def script() -> Response:
        return Response(asset("dashboard.js"), media_type="text/javascript; charset=utf-8",
                        headers={"cache-control": "no-cache"})


def step_budget(async_engine) -> int | None:
    """The engine's token budget per step (max_num_batched_tokens), when this process can see
    it: an in-process engine, or a core client that kept its EngineArgs."""
    engine = getattr(async_engine, "engine", None)
    config = getattr(getattr(engine, "scheduler", None), "config", None)
    if config is not None:
        return config.max_num_batched_tokens
    args = getattr(async_engine, "engine_args", None)
    return getattr(args, "max_num_batched_tokens", None)


def dashboard_router(state) -> APIRouter:
    """The routes of `servelm serve`; `state`: the app's ServerState."""
    router = APIRouter()
    page_routes(router)
    recorder = state.metrics.recorder
    if recorder.max_num_batched_tokens is None:
        recorder.max_num_batched_tokens = step_budget(state.async_engine)
    if getattr(state.config, "request_log", None):
        recorder.open_log(state.config.request_log)

    @router.get("/dashboard/data")
    async def data(request: Request) -> Response:
        try:
            window = parse_window(request.query_params.get("window"))
        except ValueError as exc:
            from servelm.server.errors import error_response
            return error_response(400, str(exc), param="window")
        state.metrics.refresh(state.async_engine)
        flags = {k: request.query_params.get(k) in ("1", "true") for k in ("records", "values")}
        return JSONResponse(dashboard_data(state.metrics, window,
                                           include_records=flags["records"],
                                           include_values=flags["values"]),
                            headers={"cache-control": "no-store"})

    return router


__all__ = ["PUBLIC_PATHS", "asset", "dashboard_router", "page_routes"]
