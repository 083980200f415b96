"""Per-tenant quotas on files and batches: the store (SQLite and PostgreSQL) counts each
tenant's uploaded files, their bytes and its unfinished batches; a model-free server refuses
the upload or batch beyond a quota with a 429 naming the limit, its flag and the tenant,
through the official openai client, while another project (or the same one after a delete)
goes on."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from postgres_server import postgres_server, postgres_url  # noqa: F401 - fixtures
from servelm.server.state_store import TenantUsage, open_state_store


def _file(store, tenant, num_bytes: int, purpose: str = "batch") -> str:
    from servelm.server.files_serving import file_object

    meta = file_object("f.jsonl", purpose, num_bytes)
    store.put_file(meta, b"x" * num_bytes, tenant)
    return meta["id"]


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """A SQLite file, or a database on a real PostgreSQL server."""
    url = f"sqlite:///{tmp_path / 's.sqlite3'}" if request.param == "sqlite" \
        else request.getfixturevalue("postgres_url")
    opened = open_state_store(url)
    yield opened
    opened.close()


def test_the_store_counts_each_tenants_files_bytes_and_active_batches(store):
    a, b = _file(store, "project:a", 10), _file(store, "project:a", 5)
    _file(store, "project:b", 7)
    _file(store, None, 100, "batch_output")  # a runner's output file: nobody's quota
    for i, status in enumerate(("validating", "in_progress", "completed")):
        body = {"id": f"batch_{i}", "status": "validating"}
        store.put_batch(body, "project:a")
        store.update_batch(dict(body, status=status))
    assert store.tenant_usage("project:a") == TenantUsage(2, 15, 2)
    assert store.tenant_usage("project:b") == TenantUsage(1, 7, 0)
    assert store.delete_file(a) and not store.delete_file(a)
    assert store.tenant_usage("project:a") == TenantUsage(1, 5, 2)
    assert store.tenant_usage("nobody") == TenantUsage(0, 0, 0)
    assert store.get_file(b)["bytes"] == 5


@pytest.fixture
def server(tmp_path):
    from observability.servers import fake_server

    srv = fake_server(state_store=f"sqlite:///{tmp_path / 's.sqlite3'}", step_s=0.01,
                      quota_files=2, quota_file_bytes=2000, quota_active_batches=1)
    try:
        yield srv
    finally:
        srv.stop()


def _client(server, project: str | None = None, key: str = "k1") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, project=project,
                         max_retries=0)


def _upload(client, num_bytes: int = 100):
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
            "body": {"model": "fake", "prompt": "w5 w6", "max_tokens": 2000,
                     "ignore_eos": True}}
    text = json.dumps(line) + "\n"
    return client.files.create(file=("in.jsonl", text.ljust(num_bytes).encode()),
                               purpose="batch")


def test_files_beyond_a_projects_quota_are_refused_naming_the_limit(server):
    acme, other = _client(server, "acme"), _client(server, "other")
    first = _upload(acme)
    _upload(acme)
    with pytest.raises(openai.RateLimitError) as exc:
        _upload(acme)
    err = exc.value.body
    assert exc.value.status_code == 429 and err["code"] == "file_quota_exceeded"
    assert err["param"] == "file" and err["type"] == "rate_limit_error"
    assert "project:acme" in err["message"] and "--quota-files 2" in err["message"]
    _upload(other)  # another project has its own quota
    acme.files.delete(first.id)
    _upload(acme)  # a delete makes room
    with pytest.raises(openai.RateLimitError) as exc:
        _upload(other, 1950)  # 100 + 1950 bytes > 2000
    assert exc.value.body["code"] == "file_storage_quota_exceeded"
    assert "--quota-file-bytes 2000" in exc.value.body["message"]


def test_active_batches_beyond_a_tenants_quota_are_refused(server):
    acme = _client(server, "acme")
    f = _upload(acme)
    running = acme.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h")
    with pytest.raises(openai.RateLimitError) as exc:
        acme.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                            completion_window="24h")
    err = exc.value.body
    assert err["code"] == "batch_quota_exceeded"
    assert "--quota-active-batches 1" in err["message"] and "project:acme" in err["message"]
    # Without a project, each API key is its own tenant
    keyed = _client(server, key="k2")
    g = _upload(keyed)
    other = keyed.batches.create(input_file_id=g.id, endpoint="/v1/completions",
                                 completion_window="24h")
    for b in (running, other):
        assert acme.batches.cancel(b.id).status in ("cancelling", "cancelled")


def test_a_bad_project_header_is_refused_by_name(server):
    r = httpx.post(server.url + "/v1/batches", headers={"OpenAI-Project": "p" * 200},
                   json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "OpenAI-Project"
