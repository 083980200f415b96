"""A fake OpenAI-compatible streaming server with known delays, for testing `bench serve`.

Owns: FakeServer (uvicorn in a thread on 127.0.0.1, a free port) whose /v1/completions and
/v1/chat/completions stream `max_tokens` tokens: it waits `ttft_s`, sends the first token,
then one every `tpot_s`, then a usage chunk and [DONE]. `capacity` requests are served at a
time and the rest queue (so TTFT rises with load, like a real server past its knee); faults
can be injected (an HTTP status every k-th request, a stream cut short).
Never: listens anywhere but 127.0.0.1 or runs a model.
"""

# (no `from __future__ import annotations`: FastAPI must resolve the handlers' Request type)

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass


@dataclass
class FakeBehaviour:
    ttft_s: float = 0.05
    tpot_s: float = 0.01
    capacity: int = 1_000_000  # requests served at once; the rest wait in a queue
    fail_every: int = 0  # every k-th request (1-based count) gets fail_status; 0: never
    fail_status: int = 500
    cut_every: int = 0  # every k-th request's stream stops after one token, no [DONE]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_fake_app(behaviour: FakeBehaviour):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    # received: (time.perf_counter(), `user`, prompt length) of every request, in order
    state = {"count": 0, "slots": None, "received": []}

    def sse(obj) -> bytes:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()

    async def handle(request: Request, is_chat: bool):
        body = await request.json()
        state["count"] += 1
        n = state["count"]
        b = behaviour
        if b.fail_every and n % b.fail_every == 0:
            return JSONResponse({"error": {"message": "injected", "type": "server_error"}},
                                status_code=b.fail_status)
        if state["slots"] is None:
            state["slots"] = asyncio.Semaphore(b.capacity)
        prompt = body.get("prompt") if not is_chat else body["messages"][-1]["content"]
        num_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        num_out = int(body.get("max_tokens") or 16)
        state["received"].append((time.perf_counter(), body.get("user"), num_prompt))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        is_cut = bool(b.cut_every and n % b.cut_every == 0)

        def chunk(i: int):
            if is_chat:
                return {"object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}
            return {"object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}

        async def events():
            async with state["slots"]:
                # Sleep to absolute deadlines so scheduling jitter does not accumulate.
                start = time.perf_counter()
                for i in range(num_out):
                    delay = start + b.ttft_s + i * b.tpot_s - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    yield sse(chunk(i))
                    if is_cut:
                        return
                if include_usage:
                    yield sse({"choices": [], "usage": {
                        "prompt_tokens": num_prompt, "completion_tokens": num_out,
                        "total_tokens": num_prompt + num_out}})
                yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, True)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    app.state.fake = state
    return app


class FakeServer:
    """`with FakeServer(FakeBehaviour(ttft_s=0.2)) as s: ... s.url ...`"""

    def __init__(self, behaviour: FakeBehaviour | None = None, port: int | None = None):
        self.behaviour = behaviour or FakeBehaviour()
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def num_requests(self) -> int:
        return self._app.state.fake["count"]

    @property
    def received(self) -> list[tuple[float, str | None, int]]:
        return list(self._app.state.fake["received"])

    def __enter__(self) -> "FakeServer":
        import uvicorn

        self._app = build_fake_app(self.behaviour)
        config = uvicorn.Config(self._app, host="127.0.0.1", port=self.port,
                                log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
