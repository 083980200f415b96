"""The state store, on SQLite and on a real PostgreSQL server (the same tests for both):
what one replica stores another sharing the store reads; updates of a finished response are
refused when asked to be conditional; a runner whose lease ran out reads as failed and
learns that it must stop; input items page in both orders; files keep their bytes and page
by creation; a batch is claimed by one replica at a time, changes only as its status and
holder allow, and records each line's result once; its output files and final body are
stored together or not at all."""

from __future__ import annotations

import pytest

from postgres_server import postgres_server, postgres_url  # noqa: F401 - fixtures
from servelm.server.state_store import (BatchResult, check_state_store, open_state_store,
                                        state_store_path, state_store_scheme)


@pytest.fixture(params=["sqlite", "postgresql"])
def make_store(request, tmp_path):
    """make_store(lease_s=...) -> a new connection to one store (another replica's)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'state.sqlite3'}"
    else:
        url = request.getfixturevalue("postgres_url")
    opened = []

    def make(**kwargs):
        opened.append(open_state_store(url, **kwargs))
        return opened[-1]

    make.url = url
    yield make
    for store in opened:
        store.close()


def _body(rid: str, status: str = "in_progress", **extra) -> dict:
    return {"id": rid, "status": status, "output": [], "previous_response_id": None, **extra}


def _items(n: int) -> list[dict]:
    return [{"id": f"msg_{i}", "type": "message", "role": "user",
             "content": [{"type": "input_text", "text": str(i)}]} for i in range(n)]


def test_two_replicas_share_one_store(make_store):
    a, b = make_store(), make_store()
    a.put_response(_body("resp_1", "queued"), _items(2))
    assert b.get_response("resp_1")["status"] == "queued"
    # b cancels it; a's runner finds out at its next heartbeat, and its result does not
    # overwrite the cancel
    assert b.update_response(_body("resp_1", "cancelled"), only_if_active=True)
    assert not a.heartbeat("resp_1")
    assert not a.update_response(_body("resp_1", "completed"), only_if_active=True)
    assert a.get_response("resp_1")["status"] == "cancelled"
    assert b.delete_response("resp_1") and not a.delete_response("resp_1")
    assert a.get_response("resp_1") is None and a.input_items("resp_1") is None
    a.put_response(_body("resp_2", "completed"), _items(1))
    a.close()
    b.close()
    reopened = make_store()  # as after a restart
    assert reopened.get_response("resp_2")["status"] == "completed"
    assert [i["id"] for i in reopened.input_items("resp_2").items] == ["msg_0"]


def test_a_runner_that_stopped_heartbeating_reads_failed(make_store):
    runner = make_store()
    runner.put_response(_body("resp_1"), [])
    assert runner.get_response("resp_1")["status"] == "in_progress"  # within its lease
    reader = make_store(lease_s=0.0)  # every lease has run out for it
    failed = reader.get_response("resp_1")
    assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
    assert not runner.heartbeat("resp_1")  # the runner, if alive after all, stops
    runner.put_response(_body("resp_2", "completed"), [])
    assert reader.get_response("resp_2")["status"] == "completed"  # finished: no lease


def test_input_items_pages(make_store):
    store = make_store()
    store.put_response(_body("resp_1", "completed"), _items(5))
    page = store.input_items("resp_1", limit=2, order="asc")
    assert [i["id"] for i in page.items] == ["msg_0", "msg_1"] and page.has_more
    page = store.input_items("resp_1", after="msg_1", limit=10, order="asc")
    assert [i["id"] for i in page.items] == ["msg_2", "msg_3", "msg_4"] and not page.has_more
    page = store.input_items("resp_1", after="msg_3", limit=10, order="desc")
    assert [i["id"] for i in page.items] == ["msg_2", "msg_1", "msg_0"]
    with pytest.raises(KeyError):
        store.input_items("resp_1", after="msg_9")


def _file(fid: str, purpose: str = "batch") -> dict:
    return {"id": fid, "object": "file", "purpose": purpose, "bytes": 3}


def test_files_keep_their_bytes_and_page_by_creation(make_store):
    a, b = make_store(), make_store()
    for i in range(3):
        a.put_file(_file(f"file-{i}"), bytes([i, 0, 255]))
    a.put_file(_file("file-out", "batch_output"), b"")
    assert b.file_content("file-1") == bytes([1, 0, 255]) and b.file_content("file-out") == b""
    assert b.get_file("file-2")["purpose"] == "batch"
    page = b.list_files(purpose="batch", limit=2)
    assert [f["id"] for f in page.items] == ["file-2", "file-1"] and page.has_more
    page = b.list_files(purpose="batch", after="file-1")
    assert [f["id"] for f in page.items] == ["file-0"] and not page.has_more
    assert [f["id"] for f in b.list_files(order="asc").items] == [
        "file-0", "file-1", "file-2", "file-out"]
    with pytest.raises(KeyError):
        b.list_files(after="file-9")
    assert a.delete_file("file-1") and not b.delete_file("file-1")
    assert b.get_file("file-1") is None and b.file_content("file-1") is None


def _batch(bid: str, status: str = "validating") -> dict:
    return {"id": bid, "object": "batch", "status": status,
            "request_counts": {"total": 3, "completed": 0, "failed": 0}}


def test_a_batch_is_held_by_one_replica_and_records_each_line_once(make_store):
    a, b = make_store(), make_store()
    a.put_batch(_batch("batch_1"))
    a.put_batch(_batch("batch_2", "completed"))  # finished: nobody claims it
    assert a.num_active_batches() == 1
    assert a.claim_batch("replica-a", lease_s=30)["id"] == "batch_1"
    assert b.claim_batch("replica-b", lease_s=30) is None  # held, within its lease
    assert b.heartbeat_batch("batch_1", "replica-b") is None
    assert a.heartbeat_batch("batch_1", "replica-a") == "validating"
    # only the holder moves it on, and only from the status it expects
    assert not b.update_batch(_batch("batch_1", "in_progress"), owner="replica-b")
    assert a.update_batch(_batch("batch_1", "in_progress"), only_if_status=("validating",),
                          owner="replica-a")
    assert not a.update_batch(_batch("batch_1", "in_progress"),
                              only_if_status=("validating",))
    row = {"custom_id": "c1"}
    assert a.put_batch_result("batch_1", BatchResult(1, False, row))
    assert not b.put_batch_result("batch_1", BatchResult(1, True, {"other": 1}))
    assert a.put_batch_result("batch_1", BatchResult(3, True, {"custom_id": "c3"}))
    assert b.batch_results("batch_1") == [BatchResult(1, False, row),
                                          BatchResult(3, True, {"custom_id": "c3"})]
    assert b.get_batch("batch_1")["request_counts"] == {"total": 3, "completed": 1,
                                                        "failed": 1}
    # a holder that stopped renewing its lease loses the batch to another replica
    assert b.claim_batch("replica-b", lease_s=0.0)["id"] == "batch_1"
    assert a.heartbeat_batch("batch_1", "replica-a") is None
    final = dict(_batch("batch_1", "completed"), output_file_id="file-o")
    assert not a.finish_batch(final, [(_file("file-o", "batch_output"), b"x")], "replica-a")
    assert b.get_file("file-o") is None and b.get_batch("batch_1")["status"] == "in_progress"
    assert b.finish_batch(final, [(_file("file-o", "batch_output"), b"x")], "replica-b")
    assert a.get_batch("batch_1") == final and a.file_content("file-o") == b"x"
    assert a.num_active_batches() == 0 and a.claim_batch("replica-a", lease_s=0.0) is None


def test_a_released_batch_is_claimed_at_once_and_batches_page(make_store):
    a, b = make_store(), make_store()
    for i in range(3):
        a.put_batch(_batch(f"batch_{i}", "in_progress"))
    assert a.claim_batch("replica-a", lease_s=30)["id"] == "batch_0"  # the oldest first
    a.release_batch("batch_0", "replica-a")  # a shutdown hands it back
    assert b.claim_batch("replica-b", lease_s=30)["id"] == "batch_0"
    page = b.list_batches(limit=2)
    assert [x["id"] for x in page.items] == ["batch_2", "batch_1"] and page.has_more
    # a store shared by fleets of several models: a replica claims its own model's batches
    a.put_batch(dict(_batch("batch_x", "in_progress"), model="other"))
    assert a.claim_batch("replica-a", lease_s=30, model="other")["id"] == "batch_x"
    assert a.claim_batch("replica-a", lease_s=30, model="mine") is None
    assert [x["id"] for x in b.list_batches(after="batch_1").items] == ["batch_0"]


def test_open_state_store_by_scheme(make_store):
    assert state_store_scheme(make_store.url) == make_store.url.partition(":")[0]


@pytest.mark.parametrize("url,path", [
    ("sqlite:////abs/state.db", "/abs/state.db"),
    ("sqlite:///rel/state.db", "rel/state.db"),
    ("sqlite:///:memory:", ":memory:"),
])
def test_urls(url, path):
    assert state_store_path(url) == path


@pytest.mark.parametrize("url", ["mysql://db/servelm", "state.db", "sqlite://", "sqlite:///"])
def test_bad_urls_name_the_flag(url):
    with pytest.raises(ValueError, match="--state-store"):
        check_state_store(url)


def test_an_unreachable_postgresql_server_names_the_flag():
    with pytest.raises(ValueError, match="--state-store: cannot connect to "
                       "postgresql://servelm:\\*\\*\\*@127.0.0.1:1/db"):
        check_state_store("postgresql://servelm:secret@127.0.0.1:1/db")


def test_serve_refuses_a_bad_state_store_before_loading_the_model():
    import subprocess
    import sys

    from serve_process import _free_port

    out = subprocess.run([sys.executable, "-m", "servelm.cli", "serve", "--port",
                          str(_free_port()), "--state-store", "postgresql://127.0.0.1:1/servelm"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--state-store" in out.stderr
