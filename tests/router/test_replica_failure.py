"""A replica killed under load behind the router (two `servelm serve` processes of the
default model): no request is lost that had not started streaming, the streams that had
end with an error event, the replica is ejected, and put back once it serves again."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from serve_process import ServeProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_router import _metrics, _router, _wait  # noqa: E402


# Long enough that a stream on the replica about to be killed is still running 0.5 s after
# it started (at 48 tokens, a quick moment of the machine let every such stream finish first)
TOKENS = 256


def _stream(url: str, i: int, out: dict) -> None:
    body = {"model": "smollm2-135m-instruct", "prompt": f"Story {i}: once upon a time",
            "max_tokens": TOKENS, "stream": True, "ignore_eos": True, "min_tokens": TOKENS,
            "stream_options": {"include_usage": True}}
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            out[i] = {"status": r.status_code, "replica": r.headers.get("x-servelm-replica")}
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
    except httpx.HTTPError as exc:  # the router must never let this happen
        out[i] = {"status": None, "transport_error": repr(exc)}
    out[i]["events"] = events


def test_a_replica_killed_under_load(default_model_path):
    reps = [ServeProcess("--threads", "1", "--max-num-seqs", "8") for _ in range(2)]
    router = _router([r.url for r in reps], policy="round_robin", probe_interval=0.2)
    results: dict[int, dict] = {}
    try:
        threads = [threading.Thread(target=_stream, args=(router.url, i, results))
                   for i in range(8)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        # Kill replica 0 once its streams have started.
        _wait(lambda: sum(1 for r in results.values()
                          if r.get("replica") == reps[0].url and r.get("status") == 200) >= 2,
              60)
        time.sleep(0.5)
        reps[0].proc.send_signal(signal.SIGKILL)
        # New requests sent while it is dying or gone reach the survivor (retried if they
        # hit the dead one first): none fails before its first byte.
        late = [threading.Thread(target=_stream, args=(router.url, 100 + i, results))
                for i in range(3)]
        for t in late:
            t.start()
        for t in threads + late:
            t.join(180)
        assert len(results) == 11
        broken = 0
        for i, r in results.items():
            assert r["status"] == 200, (i, r)
            assert r["events"][-1] == "[DONE]", (i, r["events"][-3:])
            errors = [json.loads(e)["error"] for e in r["events"][:-1]
                      if e.startswith('{"error"')]
            if r["replica"] == reps[0].url and errors:
                assert errors[0]["code"] == "replica_failed"
                broken += 1
            else:  # a full answer
                assert not errors, (i, errors)
                usage = json.loads(r["events"][-2])["usage"]
                assert usage["completion_tokens"] == TOKENS, (i, usage)
        assert broken >= 2  # the streams that were on the killed replica
        assert all(results[100 + i]["replica"] == reps[1].url for i in range(3))
        healthy = f'servelm_router_replica_healthy{{replica="{reps[0].url}"}}'
        _wait(lambda: _metrics(router.url)[healthy] == 0, 10)
        m = _metrics(router.url)
        assert m[f'servelm_router_ejections_total{{replica="{reps[0].url}"}}'] == 1
        assert m["servelm_router_broken_streams_total"] == broken

        # Back on the same address: readmitted, and served again.
        port = reps[0].port
        reps[0] = ServeProcess("--threads", "1", port=port)
        _wait(lambda: _metrics(router.url)[healthy] == 1, 30)
        seen = {httpx.post(router.url + "/v1/completions", timeout=60, json={
            "model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2}
        ).headers["x-servelm-replica"] for _ in range(4)}
        assert seen == {reps[0].url, reps[1].url}
    finally:
        router.stop()
        for r in reps:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
                r.proc.wait(60)
