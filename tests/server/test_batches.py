"""Files and Batches (/v1/files, /v1/batches) through the official openai client against a
live server on the default model: upload, list, content and delete of files; chat,
completion, embedding and responses batches run to completed with their output and error
files; a malformed input file failing the batch with each bad line and field named; cancel;
expiry; list pages; refusals by name; a restarted server resuming a batch without running a
finished line again (on a SQLite and on a PostgreSQL store); and interactive requests
keeping their place while a batch runs (in the lowest SLO class, never more than its seats
in the engine)."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from live_server import MODEL, LiveServer
from postgres_server import postgres_server, postgres_url  # noqa: F401 - fixtures

FINISHED = ("completed", "failed", "expired", "cancelled")


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _chat_line(i: int, max_tokens: int = 8, **extra) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content":
                                                   f"Count from {i} upwards."}],
                     "max_tokens": max_tokens, "temperature": 0, **extra}}


def _submit(client, rows: list[dict], endpoint: str = "/v1/chat/completions",
            window: str = "24h", **extra):
    f = client.files.create(file=("input.jsonl", _jsonl(rows)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint,
                                 completion_window=window, **extra)


def _wait(client, batch_id: str, until=lambda b: b.status in FINISHED, timeout=300):
    deadline = time.monotonic() + timeout  # a hang guard, not a bound on the speed
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b) or time.monotonic() > deadline:
            return b
        time.sleep(0.05)


def _lines(client, file_id: str) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def _store_url(path) -> str:
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request, tmp_path):
    """The state store's URL: a SQLite file, or a database on a real PostgreSQL server."""
    if request.param == "sqlite":
        return _store_url(tmp_path / "state.sqlite3")
    return request.getfixturevalue("postgres_url")


# First in the file: these run their own servers on the session's engine before this
# module's shared server starts (two servers must not step one engine at once).
def test_a_restarted_server_resumes_without_rerunning_finished_lines(engine, any_store):
    from servelm.server.state_store import open_state_store

    rows = [_chat_line(i, max_tokens=24, ignore_eos=True) for i in range(12)]
    first = LiveServer(engine, state_store=any_store, batch_max_inflight=1)
    try:
        client = _client(first)
        batch = _submit(client, rows)
        _wait(client, batch.id, lambda b: b.request_counts.completed >= 2)
        response = client.responses.create(model=MODEL, input="Name a colour.",
                                           max_output_tokens=4)
    finally:
        first.stop()
    store = open_state_store(any_store)
    before = {r.line: r.body for r in store.batch_results(batch.id)}
    assert store.get_batch(batch.id)["status"] == "in_progress"
    store.close()
    assert 2 <= len(before) < len(rows)
    second = LiveServer(engine, state_store=any_store, batch_max_inflight=1)
    try:
        client = _client(second)
        assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
        done = _wait(client, batch.id)
        ran = sum(v for k, v in second.metrics().items()
                  if k.startswith("servelm_requests_finished_total{"))
        out = _lines(client, done.output_file_id)
    finally:
        second.stop()
    assert done.status == "completed" and done.error_file_id is None
    assert done.request_counts.completed == len(rows) and done.request_counts.failed == 0
    assert [o["custom_id"] for o in out] == [r["custom_id"] for r in rows]
    for line, body in before.items():  # finished before the restart: kept, not run again
        assert out[line - 1] == body
    assert ran == len(rows) - len(before)


def test_interactive_requests_keep_their_place_while_a_batch_runs(engine, tmp_path):
    spec = tmp_path / "slo.json"
    spec.write_text(json.dumps({"classes": [
        {"name": "interactive", "priority": 0, "ttft_ms": 60000, "tpot_ms": 60000},
        {"name": "batch", "priority": 1, "ttft_ms": 600000, "tpot_ms": 60000}]}))
    server = LiveServer(engine, state_store=_store_url(tmp_path / "s.sqlite3"),
                        slo_spec=str(spec), batch_max_inflight=2)
    submits: list[tuple[str, int]] = []  # (class, batch lines in the engine) per submit
    in_engine: set[str] = set()
    client_side = server.state.async_engine
    original = client_side.submit

    def submit(requests):  # the event loop's only way into the engine
        cls = requests[0].slo.slo_class
        in_engine.difference_update(rid for rid in list(in_engine)
                                    if rid not in client_side._streams)
        submits.append((cls, len(in_engine)))
        if cls == "batch":
            in_engine.update(r.request_id for r in requests)
        return original(requests)

    client_side.submit = submit
    try:
        client = _client(server)
        rows = [_chat_line(i, max_tokens=32, ignore_eos=True) for i in range(16)]
        batch = _submit(client, rows)
        _wait(client, batch.id, lambda b: b.request_counts.completed >= 1)
        answers: list = []

        def ask(i: int) -> None:
            answers.append(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Hi {i}"}],
                max_tokens=4))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        during = client.batches.retrieve(batch.id)
        done = _wait(client, batch.id)
        metrics = server.metrics()
    finally:
        server.stop()
    assert len(answers) == 4
    # The interactive requests did not queue behind the batch's backlog: they finished
    # while most of its lines had not run, and each met at most the batch's two seats.
    assert during.request_counts.completed < len(rows)
    interactive = [n for cls, n in submits if cls == "interactive"]
    assert len(interactive) == 4 and max(interactive) <= 2
    assert max(n for cls, n in submits if cls == "batch") < 2  # its seats, never more
    assert done.status == "completed" and done.request_counts.completed == len(rows)
    # Every line ran in the lowest class; the interactive ones in the default class.
    assert metrics['servelm_slo_window_requests{slo_class="batch"}'] == len(rows)
    assert metrics['servelm_slo_window_requests{slo_class="interactive"}'] == 4


def test_the_file_size_limit_is_a_413(engine, tmp_path):
    server = LiveServer(engine, state_store=_store_url(tmp_path / "s.sqlite3"),
                        max_file_bytes=100)
    try:
        client = _client(server)
        ok = client.files.create(file=("ok.jsonl", b"x" * 100), purpose="batch")
        assert ok.bytes == 100
        with pytest.raises(openai.APIStatusError) as e:
            client.files.create(file=("big.jsonl", b"x" * 101), purpose="batch")
        assert e.value.status_code == 413 and e.value.body["param"] == "file"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    s = LiveServer(engine, state_store=_store_url(tmp_path_factory.mktemp("batches") /
                                                  "state.sqlite3"), batch_max_inflight=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


def test_files_upload_list_content_delete(client):
    data = _jsonl([_chat_line(0)])
    f = client.files.create(file=("mine.jsonl", data), purpose="batch")
    assert f.object == "file" and f.id.startswith("file-") and f.bytes == len(data)
    assert f.filename == "mine.jsonl" and f.purpose == "batch" and f.status == "processed"
    assert client.files.retrieve(f.id).model_dump() == f.model_dump()
    assert client.files.content(f.id).content == data
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    g = client.files.create(file=("other.jsonl", data), purpose="batch")
    page = client.files.list(limit=1)  # newest first
    assert [x.id for x in page.data] == [g.id] and page.has_more
    assert client.files.list(limit=1, after=g.id).data[0].id == f.id
    deleted = client.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)


def test_file_refusals_name_the_field(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    with server.client() as c:
        r = c.post("/v1/files", files={"file": ("x.jsonl", b"{}")},
                   data={"purpose": "batch", "colour": "red"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "colour"
        r = c.post("/v1/files", data={"purpose": "batch"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "file"


def test_a_chat_batch_completes_with_output_and_error_files(client):
    rows = [_chat_line(i) for i in range(4)]
    rows.insert(2, _chat_line(9, temperature="hot"))  # refused by the endpoint: fails alone
    batch = _submit(client, rows, metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.object == "batch"
    assert batch.metadata == {"job": "nightly"} and batch.completion_window == "24h"
    assert batch.expires_at - batch.created_at == 24 * 3600
    done = _wait(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (5, 4, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = _lines(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2", "req-3"]
    for o in out:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]
        assert o["response"]["request_id"] == body["id"]
    (err,) = _lines(client, done.error_file_id)
    assert err["custom_id"] == "req-9" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "temperature"
    assert "temperature" in err["error"]["message"]
    usage = done.usage
    assert usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"]
                                     for o in out)
    assert usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"]
                                      for o in out)
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


@pytest.mark.parametrize("endpoint,body,check", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4},
     lambda b: b["object"] == "text_completion" and b["choices"][0]["text"]),
    ("/v1/embeddings", {"input": "a sentence to embed"},
     lambda b: b["object"] == "list" and len(b["data"][0]["embedding"]) > 0),
    ("/v1/responses", {"input": "Say hi.", "max_output_tokens": 4},
     lambda b: b["object"] == "response" and b["output"]),
])
def test_each_endpoint_runs_in_a_batch(client, endpoint, body, check):
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": endpoint,
             "body": {"model": MODEL, **body}} for i in range(2)]
    done = _wait(client, _submit(client, rows, endpoint=endpoint).id)
    assert done.status == "completed" and done.request_counts.completed == 2, done
    out = _lines(client, done.output_file_id)
    assert all(o["response"]["status_code"] == 200 and check(o["response"]["body"])
               for o in out), out


def test_a_malformed_file_fails_naming_each_line_and_field(client):
    good = _chat_line(0)
    text = "\n".join([
        json.dumps(good),
        "{not json",
        json.dumps({k: v for k, v in _chat_line(1).items() if k != "custom_id"}),
        json.dumps(dict(_chat_line(2), url="/v1/completions")),
        json.dumps(dict(_chat_line(0))),  # custom_id used by line 1
        json.dumps(dict(_chat_line(3), body={"messages": [], "stream": True})),
    ]).encode()
    f = client.files.create(file=("bad.jsonl", text), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = _wait(client, batch.id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    got = [(e.line, e.param, e.code) for e in done.errors.data]
    assert got == [(2, None, "invalid_json_line"), (3, "custom_id", "invalid_request"),
                   (4, "url", "mismatched_endpoint"), (5, "custom_id", "duplicate_custom_id"),
                   (6, "body.stream", "invalid_request")]
    assert all(e.message.startswith(f"line {e.line}: ") for e in done.errors.data)


def test_cancel_stops_the_batch(client):
    rows = [_chat_line(i, max_tokens=48, ignore_eos=True) for i in range(30)]
    batch = _submit(client, rows)
    _wait(client, batch.id, lambda b: b.status == "in_progress")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert done.request_counts.completed < len(rows)
    again = client.batches.cancel(batch.id)  # harmless
    assert again.status == "cancelled"


def test_a_batch_past_its_window_expires(client):
    rows = [_chat_line(i, max_tokens=64, ignore_eos=True) for i in range(40)]
    batch = _submit(client, rows, window="1s")
    done = _wait(client, batch.id)
    assert done.status == "expired" and done.expired_at
    errors = _lines(client, done.error_file_id)
    expired = [e for e in errors if e["error"]["code"] == "batch_expired"]
    assert expired and len(expired) + done.request_counts.completed == len(rows)


def test_list_batches_newest_first(client):
    a = _submit(client, [_chat_line(0, max_tokens=1)])
    b = _submit(client, [_chat_line(1, max_tokens=1)])
    page = client.batches.list(limit=1)
    assert [x.id for x in page.data] == [b.id] and page.has_more
    assert client.batches.list(limit=1, after=b.id).data[0].id == a.id
    for x in (a, b):
        _wait(client, x.id)


def test_batch_refusals_name_the_field(client):
    f = client.files.create(file=("in.jsonl", _jsonl([_chat_line(0)])), purpose="batch")
    bad = [
        (dict(endpoint="/v1/moderations"), "endpoint"),
        (dict(completion_window="soon"), "completion_window"),
        (dict(input_file_id="file-nope"), "input_file_id"),
        (dict(metadata={"k": "v" * 600}), "metadata"),
        (dict(extra_body={"priority": 1}), "priority"),
    ]
    for change, param in bad:
        args = dict(input_file_id=f.id, endpoint="/v1/chat/completions",
                    completion_window="24h")
        args.update(change)
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(**args)
        assert e.value.body["param"] == param, (change, e.value.body)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    done = _wait(client, _submit(client, [_chat_line(0, max_tokens=1)]).id)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(done.id)
