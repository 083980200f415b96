"""The SQLite state store: what one replica stores another sharing the file reads; updates
of a finished response are refused when asked to be conditional; a runner whose lease ran out
reads as failed and learns that it must stop; input items page in both orders."""

from __future__ import annotations

import pytest

from servelm.server.state_store import SQLiteStateStore, open_state_store, state_store_path


def _body(rid: str, status: str = "in_progress", **extra) -> dict:
    return {"id": rid, "status": status, "output": [], "previous_response_id": None, **extra}


def _items(n: int) -> list[dict]:
    return [{"id": f"msg_{i}", "type": "message", "role": "user",
             "content": [{"type": "input_text", "text": str(i)}]} for i in range(n)]


def test_two_replicas_share_one_file(tmp_path):
    path = tmp_path / "state.sqlite3"
    a, b = SQLiteStateStore(path), SQLiteStateStore(path)
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
    a.close()
    b.close()
    reopened = open_state_store(f"sqlite:///{path}")  # as after a restart
    assert reopened.get_response("resp_1") is None
    reopened.close()


def test_a_runner_that_stopped_heartbeating_reads_failed(tmp_path):
    path = tmp_path / "state.sqlite3"
    runner = SQLiteStateStore(path)
    runner.put_response(_body("resp_1"), [])
    assert runner.get_response("resp_1")["status"] == "in_progress"  # within its lease
    reader = SQLiteStateStore(path, lease_s=0.0)  # every lease has run out for it
    failed = reader.get_response("resp_1")
    assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
    assert not runner.heartbeat("resp_1")  # the runner, if alive after all, stops
    runner.put_response(_body("resp_2", "completed"), [])
    assert reader.get_response("resp_2")["status"] == "completed"  # finished: no lease


def test_input_items_pages(tmp_path):
    store = SQLiteStateStore(tmp_path / "state.sqlite3")
    store.put_response(_body("resp_1", "completed"), _items(5))
    page = store.input_items("resp_1", limit=2, order="asc")
    assert [i["id"] for i in page.items] == ["msg_0", "msg_1"] and page.has_more
    page = store.input_items("resp_1", after="msg_1", limit=10, order="asc")
    assert [i["id"] for i in page.items] == ["msg_2", "msg_3", "msg_4"] and not page.has_more
    page = store.input_items("resp_1", after="msg_3", limit=10, order="desc")
    assert [i["id"] for i in page.items] == ["msg_2", "msg_1", "msg_0"]
    with pytest.raises(KeyError):
        store.input_items("resp_1", after="msg_9")


@pytest.mark.parametrize("url,path", [
    ("sqlite:////abs/state.db", "/abs/state.db"),
    ("sqlite:///rel/state.db", "rel/state.db"),
    ("sqlite:///:memory:", ":memory:"),
])
def test_urls(url, path):
    assert state_store_path(url) == path


@pytest.mark.parametrize("url", ["postgresql://db/servelm", "state.db", "sqlite://", "sqlite:///"])
def test_bad_urls_name_the_flag(url):
    with pytest.raises(ValueError, match="--state-store"):
        state_store_path(url)


def test_serve_refuses_a_bad_state_store_before_loading_the_model():
    import subprocess
    import sys

    from serve_process import _free_port

    out = subprocess.run([sys.executable, "-m", "servelm.cli", "serve", "--port",
                          str(_free_port()), "--state-store", "postgresql://db/servelm"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--state-store" in out.stderr
