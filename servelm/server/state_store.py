"""StateStore: the durable API state of the Responses API, outside any replica's memory.

Owns: stored responses (the Response object as the API returns it, its status as a column
for conditional updates) and each response's own input items, by response id; the lease of
a running background response (its runner touches `heartbeat_at`; a queued or in-progress
response whose runner stopped touching it for `lease_s` reads as failed, so a replica that
died never leaves a response in progress forever); and the choice of an implementation by
URL (`sqlite:///path` as SQLAlchemy reads it; default: a file in $SERVELM_HOME). SQLite runs
in WAL mode, so several replicas on one machine share one file and a restart finds what was
stored.
Never: runs a model, knows HTTP, or interprets a response beyond its id, status and
previous_response_id: the server builds the bodies, the store keeps them. Every method is
blocking I/O: the server calls it off the event loop.

A PostgreSQL implementation (a fleet on several machines) implements the same abstract
methods over the same two tables; the statements are plain SQL apart from the placeholders.
"""

from __future__ import annotations

import abc
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

# Statuses of a response still running: only these may change (cancel, the runner's result).
ACTIVE_STATUSES = ("queued", "in_progress")
DEFAULT_LEASE_S = 30.0


class ItemPage(NamedTuple):
    items: list[dict[str, Any]]
    has_more: bool


class StateStore(abc.ABC):
    """Responses and their input items, by id. Bodies are JSON objects with `id`, `status`
    and `previous_response_id`."""

    @abc.abstractmethod
    def put_response(self, body: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Store a new response and the input items of its own request (not its chain's)."""

    @abc.abstractmethod
    def get_response(self, response_id: str) -> dict[str, Any] | None:
        """The stored body (None: unknown or deleted); an active one whose lease ran out
        is marked failed first."""

    @abc.abstractmethod
    def update_response(self, body: dict[str, Any], *, only_if_active: bool = False) -> bool:
        """Replace a stored body (found by body["id"]); with only_if_active, only while its
        status is queued or in_progress (a cancel or a delete wins). True if replaced."""

    @abc.abstractmethod
    def heartbeat(self, response_id: str) -> bool:
        """The runner of an active response is alive; False when it is no longer active
        (cancelled, deleted), which tells the runner to stop."""

    @abc.abstractmethod
    def delete_response(self, response_id: str) -> bool:
        """Forget a response and its input items; False if it was not stored."""

    @abc.abstractmethod
    def input_items(self, response_id: str, *, after: str | None = None, limit: int = 20,
                    order: str = "desc") -> ItemPage | None:
        """A page of a response's input items (None: unknown response; after: an item id
        of the previous page, which must be one of this response's)."""

    def close(self) -> None:
        """Release connections."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    body TEXT NOT NULL,
    created_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS input_items (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (response_id, position)
);
"""


class SQLiteStateStore(StateStore):
    """One SQLite file in WAL mode (readers never wait for the writer; several processes
    share it, each waiting up to `busy_timeout_s` for a write lock)."""

    def __init__(self, path: str | Path, lease_s: float = DEFAULT_LEASE_S,
                 busy_timeout_s: float = 10.0):
        self.path = str(path)
        self.lease_s = lease_s
        if self.path != ":memory:":
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # one connection, used from worker threads
        self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at each checkpoint
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)

    def _run(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def put_response(self, body, input_items):
        now = time.time()
        rows = [(body["id"], i, item["id"], json.dumps(item, ensure_ascii=False))
                for i, item in enumerate(input_items)]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT INTO responses (id, status, body, created_at, heartbeat_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (body["id"], body["status"], json.dumps(body, ensure_ascii=False), now, now))
                self._db.executemany("INSERT INTO input_items (response_id, position, item_id, "
                                     "body) VALUES (?, ?, ?, ?)", rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get_response(self, response_id):
        row = self._run("SELECT status, body, heartbeat_at FROM responses WHERE id = ?",
                        (response_id,)).fetchone()
        if row is None:
            return None
        status, text, heartbeat_at = row
        body = json.loads(text)
        if status in ACTIVE_STATUSES and time.time() - heartbeat_at > self.lease_s:
            body = dict(body, status="failed", output=[], error={
                "code": "server_error",
                "message": "the server running this response stopped before it finished"})
            if not self.update_response(body, only_if_active=True):
                return self.get_response(response_id)  # it finished meanwhile
        return body

    def update_response(self, body, *, only_if_active=False):
        sql = "UPDATE responses SET status = ?, body = ?, heartbeat_at = ? WHERE id = ?"
        if only_if_active:
            sql += f" AND status IN {ACTIVE_STATUSES!r}"
        cur = self._run(sql, (body["status"], json.dumps(body, ensure_ascii=False),
                              time.time(), body["id"]))
        return cur.rowcount == 1

    def heartbeat(self, response_id):
        cur = self._run(f"UPDATE responses SET heartbeat_at = ? WHERE id = ? AND status IN "
                        f"{ACTIVE_STATUSES!r}", (time.time(), response_id))
        return cur.rowcount == 1

    def delete_response(self, response_id):
        return self._run("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount == 1

    def input_items(self, response_id, *, after=None, limit=20, order="desc"):
        if self._run("SELECT 1 FROM responses WHERE id = ?", (response_id,)).fetchone() is None:
            return None
        desc = order == "desc"
        where, args = "response_id = ?", [response_id]
        if after is not None:
            row = self._run("SELECT position FROM input_items WHERE response_id = ? AND "
                            "item_id = ?", (response_id, after)).fetchone()
            if row is None:
                raise KeyError(after)
            where += " AND position < ?" if desc else " AND position > ?"
            args.append(row[0])
        rows = self._run(f"SELECT body FROM input_items WHERE {where} ORDER BY position "
                         f"{'DESC' if desc else 'ASC'} LIMIT ?", (*args, limit + 1)).fetchall()
        items = [json.loads(r[0]) for r in rows[:limit]]
        return ItemPage(items, len(rows) > limit)

    def close(self):
        with self._lock:
            self._db.close()


def default_state_store_url() -> str:
    """sqlite:/// + $SERVELM_HOME/state.sqlite3 (the model cache's home)."""
    from servelm.loader.model_cache import cache_home

    return f"sqlite:///{cache_home() / 'state.sqlite3'}"


def state_store_path(url: str | None) -> str:
    """The SQLite file a `--state-store` URL names (None: the default file); a ValueError
    naming the flag for any other URL (checked at start-up)."""
    url = url or default_state_store_url()
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "sqlite":
        raise ValueError(f"--state-store: unsupported URL {url!r} (expected "
                         "sqlite:///PATH)")
    if not rest.startswith("/") or rest == "/":
        raise ValueError(f"--state-store: {url!r} names no file (expected sqlite:///PATH)")
    # As SQLAlchemy reads them: sqlite:///rel/path, sqlite:////abs/path, sqlite:///:memory:
    return rest[1:]


def open_state_store(url: str | None) -> StateStore:
    """The store a `--state-store` URL names (None: the default file)."""
    return SQLiteStateStore(state_store_path(url))

__all__ = ["ACTIVE_STATUSES", "ItemPage", "SQLiteStateStore", "StateStore",
           "default_state_store_url", "open_state_store", "state_store_path"]
