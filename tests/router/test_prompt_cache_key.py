"""OpenAI's `prompt_cache_key` at the router: prefix_affinity sends the requests sharing a key
to one replica while no replica holds their prefix (the cache view wins once one does, and the
load bound still holds); through a live router to two replicas, each key's requests meet on
one replica; and the router forwards DELETE (a response or file deleted through it)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import httpx

from servelm.router.policies import ReplicaLoad, RouteRequest, make_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_router import _replica, _router, _port  # noqa: E402


def _home(key: str, n: int) -> int:
    """The replica rendezvous hashing gives a key among n that all fit."""
    return max(range(n), key=lambda i: hashlib.sha256(f"{key}|{i}".encode()).digest())


def _keys_on_different_replicas(n: int = 2) -> tuple[str, str]:
    keys = [f"key-{i}" for i in range(64)]
    first = keys[0]
    return first, next(k for k in keys if _home(k, n) != _home(first, n))


def _load(tokens=0, cached=0, healthy=True):
    return ReplicaLoad(0, 0, tokens, 0.0, healthy, cached)


def test_a_key_picks_its_replica_until_one_holds_the_prefix():
    pa = make_policy("prefix_affinity")
    a, b = _keys_on_different_replicas(3)
    idle = [_load(), _load(), _load()]
    assert pa.pick(idle, RouteRequest(100, cache_key=a)) == _home(a, 3)
    assert pa.pick(idle, RouteRequest(100, cache_key=b)) == _home(b, 3)
    assert pa.pick(idle, RouteRequest(100)) == 0  # no key: ties go to the first
    # a little load elsewhere does not move a key; the cache view, once there, decides
    loaded = [_load(tokens=50) for _ in range(3)]
    assert pa.pick(loaded, RouteRequest(100, cache_key=a)) == _home(a, 3)
    cached = [_load(cached=64) if i != _home(a, 3) else _load() for i in range(3)]
    assert pa.pick(cached, RouteRequest(100, cache_key=a)) != _home(a, 3)
    # the load bound holds: a key's replica far above the mean is not picked
    over = [_load(tokens=10_000) if i == _home(a, 3) else _load() for i in range(3)]
    assert pa.pick(over, RouteRequest(100, cache_key=a)) != _home(a, 3)


def test_requests_sharing_a_key_meet_on_one_replica_through_the_router(tmp_path):
    reps = [_replica(_port()) for _ in range(2)]
    router = _router([r.url for r in reps], policy="prefix_affinity")
    try:
        a, b = _keys_on_different_replicas(2)
        seen: dict[str, set[str]] = {a: set(), b: set()}
        for i in range(6):
            for key in (a, b):  # different prompts: nothing cached for the router to see
                body = {"model": "fake", "prompt": [7, i, 100 + i], "max_tokens": 2,
                        "prompt_cache_key": key}
                r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
                seen[key].add(r.headers["x-servelm-replica"])
        assert len(seen[a]) == 1 and len(seen[b]) == 1 and seen[a] != seen[b]
        r = httpx.post(router.url + "/v1/completions", timeout=30,
                       json={"model": "fake", "prompt": [1], "prompt_cache_key": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"
    finally:
        router.stop()
        for rep in reps:
            rep.stop()


def test_the_router_forwards_delete(tmp_path):
    from servelm.server.app import ServerConfig, build_app
    from test_router import _Uvicorn
    from fake_runner import FakeRunner, make_engine

    store = f"sqlite:///{tmp_path / 'state.sqlite3'}"  # one store for both replicas
    reps = [_Uvicorn(build_app(make_engine(num_blocks=64, runner=FakeRunner(block_size=4)),
                               ServerConfig(served_model_name="fake", state_store=store)),
                     _port()) for _ in range(2)]
    router = _router([r.url for r in reps])
    try:
        up = httpx.post(router.url + "/v1/files", files={"file": ("in.jsonl", b"{}\n")},
                        data={"purpose": "batch"}, timeout=30)
        assert up.status_code == 200, up.text
        file_id = up.json()["id"]
        gone = httpx.delete(f"{router.url}/v1/files/{file_id}", timeout=30)
        assert gone.status_code == 200 and gone.json()["deleted"] is True
        assert httpx.get(f"{router.url}/v1/files/{file_id}").status_code == 404
        # a response is deleted the same way (this one was never stored: the replica's 404)
        r = httpx.delete(f"{router.url}/v1/responses/resp_nope", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    finally:
        router.stop()
        for rep in reps:
            rep.stop()
