"""StateStore: the durable API state (responses, files, batches), outside any replica's memory.

Owns: stored responses (the Response object as the API returns it, its status as a column
for conditional updates) and each response's own input items, by response id; the lease of
a running background response (its runner touches `heartbeat_at`; a queued or in-progress
response whose runner stopped touching it for `lease_s` reads as failed, so a replica that
died never leaves a response in progress forever); uploaded and generated files (metadata
and bytes); batches (the Batch object, the replica running it under a lease, and each
finished line's result, written once: a resumed batch never runs a finished line again);
the tenant (a project or an API key: servelm/server/batch_quota.py) each uploaded file and
batch counts against, and its usage;
and the choice of an implementation by URL (`sqlite:///path` as SQLAlchemy reads it, the
default a file in $SERVELM_HOME; `postgresql://...` for a fleet on several machines,
servelm/server/state_store_postgres.py). SQLite runs in WAL mode, so several replicas on
one machine share one file and a restart finds what was stored.
Never: runs a model, knows HTTP, or interprets a body beyond its id, status and
previous_response_id: the server builds the bodies, the store keeps them. Every method is
blocking I/O: the server calls it off the event loop.

Both implementations run the same statements (SQLStateStore); a dialect differs only in its
placeholders, its bytes column type and how it opens a transaction.
"""

from __future__ import annotations

import abc
import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

# Statuses of a response still running: only these may change (cancel, the runner's result).
ACTIVE_STATUSES = ("queued", "in_progress")
# Statuses of a batch some replica must still work on (claim_batch hands them out).
ACTIVE_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
DEFAULT_LEASE_S = 30.0


class ItemPage(NamedTuple):
    items: list[dict[str, Any]]
    has_more: bool


class BatchResult(NamedTuple):
    """One finished line of a batch: its output-file (or error-file) line."""

    line: int
    is_error: bool
    body: dict[str, Any]


class TenantUsage(NamedTuple):
    """What one tenant holds: its uploaded files (not deleted) and its unfinished batches."""

    num_files: int
    num_file_bytes: int
    num_active_batches: int


class StateStore(abc.ABC):
    """Responses and their input items, files and batches, by id. Bodies are JSON objects
    with `id` and, for responses and batches, `status`."""

    # -- responses ---------------------------------------------------------------------------

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

    # -- files -------------------------------------------------------------------------------

    @abc.abstractmethod
    def put_file(self, body: dict[str, Any], content: bytes, tenant: str | None = None) -> None:
        """Store a new file: its File object (with `purpose`) and its bytes; an upload
        counts against `tenant`'s quota."""

    @abc.abstractmethod
    def get_file(self, file_id: str) -> dict[str, Any] | None:
        """The File object (None: unknown or deleted)."""

    @abc.abstractmethod
    def file_content(self, file_id: str) -> bytes | None:
        """The file's bytes (None: unknown or deleted)."""

    @abc.abstractmethod
    def list_files(self, *, purpose: str | None = None, after: str | None = None,
                   limit: int = 20, order: str = "desc") -> ItemPage:
        """A page of File objects by creation time; KeyError when `after` is no file."""

    @abc.abstractmethod
    def delete_file(self, file_id: str) -> bool:
        """Forget a file; False if it was not stored."""

    # -- batches -----------------------------------------------------------------------------

    @abc.abstractmethod
    def put_batch(self, body: dict[str, Any], tenant: str | None = None) -> None:
        """Store a new batch (status validating, no owner: any replica may claim it),
        counted against `tenant`'s quota."""

    @abc.abstractmethod
    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        """The Batch object; while active, its request_counts are the results stored."""

    @abc.abstractmethod
    def update_batch(self, body: dict[str, Any], *, only_if_status: tuple[str, ...] = (),
                     owner: str | None = None) -> bool:
        """Replace a stored body; only while its status is one of `only_if_status` (when
        given) and, with `owner`, only while that owner holds it. True if replaced."""

    @abc.abstractmethod
    def list_batches(self, *, after: str | None = None, limit: int = 20) -> ItemPage:
        """A page of Batch objects, newest first; KeyError when `after` is no batch."""

    @abc.abstractmethod
    def num_active_batches(self) -> int:
        """Batches not yet completed, failed, expired or cancelled."""

    @abc.abstractmethod
    def tenant_usage(self, tenant: str) -> TenantUsage:
        """The files (stored, with their bytes) and active batches counted against tenant."""

    @abc.abstractmethod
    def claim_batch(self, owner: str, lease_s: float,
                    model: str | None = None) -> dict[str, Any] | None:
        """The oldest active batch (of `model`, when given: a store may be shared by fleets
        serving different models) that no replica holds (or whose holder stopped touching
        it for lease_s), now held by `owner`; None when there is none."""

    @abc.abstractmethod
    def heartbeat_batch(self, batch_id: str, owner: str) -> str | None:
        """The holder is alive: its batch's status, or None when it no longer holds it."""

    @abc.abstractmethod
    def release_batch(self, batch_id: str, owner: str) -> None:
        """The holder lets go (a shutdown): another replica may claim it at once."""

    @abc.abstractmethod
    def put_batch_result(self, batch_id: str, result: BatchResult) -> bool:
        """Record a finished line once; False when that line already has its result."""

    @abc.abstractmethod
    def batch_results(self, batch_id: str) -> list[BatchResult]:
        """The finished lines, in line order."""

    @abc.abstractmethod
    def finish_batch(self, body: dict[str, Any], files: list[tuple[dict[str, Any], bytes]],
                     owner: str) -> bool:
        """In one transaction: store the output files and the batch's final body, while
        `owner` holds it. False (nothing stored) when it no longer does."""

    def close(self) -> None:
        """Release connections."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    body TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    heartbeat_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS input_items (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (response_id, position)
);
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    body TEXT NOT NULL,
    content {bytes} NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    body TEXT NOT NULL,
    owner TEXT,
    heartbeat_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS batch_results (
    batch_id TEXT NOT NULL REFERENCES batches(id) ON DELETE CASCADE,
    line INTEGER NOT NULL,
    is_error INTEGER NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
CREATE TABLE IF NOT EXISTS tenants (
    object_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS tenants_by_tenant ON tenants (tenant)
"""

Execute = Callable[[str, tuple], Any]  # (sql, args) -> cursor, inside a transaction


def _dumps(body: Any) -> str:
    return json.dumps(body, ensure_ascii=False)


def _in(statuses: tuple[str, ...]) -> str:
    """An SQL list of literal statuses (constants of this module, never client text)."""
    return "(" + ", ".join(f"'{s}'" for s in statuses) + ")"


class SQLStateStore(StateStore):
    """The statements, written with `?` placeholders; a dialect supplies `_query` (rows),
    `_exec` (rowcount) and `_transaction` (an Execute inside one transaction)."""

    lease_s: float

    @abc.abstractmethod
    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        """All rows of a statement."""

    @abc.abstractmethod
    def _exec(self, sql: str, args: tuple = ()) -> int:
        """The rows a statement changed."""

    @abc.abstractmethod
    def _transaction(self) -> Any:
        """A context manager giving an Execute whose statements commit together."""

    def _one(self, sql: str, args: tuple = ()) -> tuple | None:
        rows = self._query(sql, args)
        return rows[0] if rows else None

    # -- responses ---------------------------------------------------------------------------

    def put_response(self, body, input_items):
        now = time.time()
        with self._transaction() as execute:
            execute("INSERT INTO responses (id, status, body, created_at, heartbeat_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (body["id"], body["status"], _dumps(body), now, now))
            for i, item in enumerate(input_items):
                execute("INSERT INTO input_items (response_id, position, item_id, body) "
                        "VALUES (?, ?, ?, ?)", (body["id"], i, item["id"], _dumps(item)))

    def get_response(self, response_id):
        row = self._one("SELECT status, body, heartbeat_at FROM responses WHERE id = ?",
                        (response_id,))
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
            sql += f" AND status IN {_in(ACTIVE_STATUSES)}"
        return self._exec(sql, (body["status"], _dumps(body), time.time(), body["id"])) == 1

    def heartbeat(self, response_id):
        return self._exec(f"UPDATE responses SET heartbeat_at = ? WHERE id = ? AND status IN "
                          f"{_in(ACTIVE_STATUSES)}", (time.time(), response_id)) == 1

    def delete_response(self, response_id):
        with self._transaction() as execute:  # PostgreSQL's cascade needs no pragma either
            execute("DELETE FROM input_items WHERE response_id = ?", (response_id,))
            return execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount == 1

    def input_items(self, response_id, *, after=None, limit=20, order="desc"):
        if self._one("SELECT 1 FROM responses WHERE id = ?", (response_id,)) is None:
            return None
        desc = order == "desc"
        where, args = "response_id = ?", [response_id]
        if after is not None:
            row = self._one("SELECT position FROM input_items WHERE response_id = ? AND "
                            "item_id = ?", (response_id, after))
            if row is None:
                raise KeyError(after)
            where += " AND position < ?" if desc else " AND position > ?"
            args.append(row[0])
        rows = self._query(f"SELECT body FROM input_items WHERE {where} ORDER BY position "
                           f"{'DESC' if desc else 'ASC'} LIMIT ?", (*args, limit + 1))
        return ItemPage([json.loads(r[0]) for r in rows[:limit]], len(rows) > limit)

    # -- files -------------------------------------------------------------------------------

    def put_file(self, body, content, tenant=None):
        with self._transaction() as execute:
            self._insert_file(execute, body, content)
            if tenant is not None:
                execute("INSERT INTO tenants (object_id, tenant) VALUES (?, ?)",
                        (body["id"], tenant))

    @staticmethod
    def _insert_file(execute: Execute, body: dict[str, Any], content: bytes) -> None:
        execute("INSERT INTO files (id, purpose, created_at, body, content) VALUES "
                "(?, ?, ?, ?, ?)", (body["id"], body["purpose"], time.time(), _dumps(body),
                                    content))

    def get_file(self, file_id):
        row = self._one("SELECT body FROM files WHERE id = ?", (file_id,))
        return None if row is None else json.loads(row[0])

    def file_content(self, file_id):
        row = self._one("SELECT content FROM files WHERE id = ?", (file_id,))
        return None if row is None else bytes(row[0])

    def list_files(self, *, purpose=None, after=None, limit=20, order="desc"):
        where, args = ("purpose = ?", [purpose]) if purpose is not None else ("1 = 1", [])
        return self._page("files", where, args, after, limit, order)

    def _page(self, table: str, where: str, args: list, after: str | None, limit: int,
              order: str) -> ItemPage:
        """Rows by (created_at, id), after the row `after` in that order."""
        desc = order == "desc"
        if after is not None:
            row = self._one(f"SELECT created_at FROM {table} WHERE id = ?", (after,))
            if row is None:
                raise KeyError(after)
            cmp = "<" if desc else ">"
            where += f" AND (created_at {cmp} ? OR (created_at = ? AND id {cmp} ?))"
            args += [row[0], row[0], after]
        direction = "DESC" if desc else "ASC"
        rows = self._query(f"SELECT body FROM {table} WHERE {where} ORDER BY created_at "
                           f"{direction}, id {direction} LIMIT ?", (*args, limit + 1))
        return ItemPage([json.loads(r[0]) for r in rows[:limit]], len(rows) > limit)

    def delete_file(self, file_id):
        with self._transaction() as execute:
            execute("DELETE FROM tenants WHERE object_id = ?", (file_id,))
            return execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 1

    # -- batches -----------------------------------------------------------------------------

    def put_batch(self, body, tenant=None):
        now = time.time()
        with self._transaction() as execute:
            execute("INSERT INTO batches (id, status, created_at, body, owner, heartbeat_at) "
                    "VALUES (?, ?, ?, ?, NULL, ?)",
                    (body["id"], body["status"], now, _dumps(body), now))
            if tenant is not None:
                execute("INSERT INTO tenants (object_id, tenant) VALUES (?, ?)",
                        (body["id"], tenant))

    def get_batch(self, batch_id):
        row = self._one("SELECT status, body FROM batches WHERE id = ?", (batch_id,))
        if row is None:
            return None
        body = json.loads(row[1])
        if row[0] in ACTIVE_BATCH_STATUSES:
            done, failed = self._one("SELECT COUNT(*), COALESCE(SUM(is_error), 0) FROM "
                                     "batch_results WHERE batch_id = ?", (batch_id,))
            counts = body.get("request_counts") or {"total": 0}
            body["request_counts"] = {"total": counts["total"],
                                      "completed": int(done) - int(failed),
                                      "failed": int(failed)}
        return body

    def update_batch(self, body, *, only_if_status=(), owner=None):
        sql = "UPDATE batches SET status = ?, body = ? WHERE id = ?"
        args: tuple = (body["status"], _dumps(body), body["id"])
        if only_if_status:
            sql += f" AND status IN {_in(only_if_status)}"
        if owner is not None:
            sql += " AND owner = ?"
            args += (owner,)
        return self._exec(sql, args) == 1

    def list_batches(self, *, after=None, limit=20):
        return self._page("batches", "1 = 1", [], after, limit, "desc")

    def num_active_batches(self):
        return int(self._one(f"SELECT COUNT(*) FROM batches WHERE status IN "
                             f"{_in(ACTIVE_BATCH_STATUSES)}")[0])

    def tenant_usage(self, tenant):
        num_files, num_bytes = self._one(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(f.content)), 0) FROM tenants t JOIN files f "
            "ON f.id = t.object_id WHERE t.tenant = ?", (tenant,))
        num_batches = self._one(
            f"SELECT COUNT(*) FROM tenants t JOIN batches b ON b.id = t.object_id WHERE "
            f"t.tenant = ? AND b.status IN {_in(ACTIVE_BATCH_STATUSES)}", (tenant,))[0]
        return TenantUsage(int(num_files), int(num_bytes), int(num_batches))

    def claim_batch(self, owner, lease_s, model=None):
        now = time.time()
        free = "(owner IS NULL OR heartbeat_at < ?)"
        rows = self._query(f"SELECT id, body FROM batches WHERE status IN "
                           f"{_in(ACTIVE_BATCH_STATUSES)} AND {free} ORDER BY created_at, id "
                           f"LIMIT 64", (now - lease_s,))
        for batch_id, body in rows:  # another replica may take one between the statements
            if model is not None and json.loads(body).get("model") != model:
                continue
            if self._exec(f"UPDATE batches SET owner = ?, heartbeat_at = ? WHERE id = ? AND "
                          f"{free}", (owner, now, batch_id, now - lease_s)) == 1:
                return self.get_batch(batch_id)
        return None

    def heartbeat_batch(self, batch_id, owner):
        if self._exec("UPDATE batches SET heartbeat_at = ? WHERE id = ? AND owner = ?",
                      (time.time(), batch_id, owner)) != 1:
            return None
        row = self._one("SELECT status FROM batches WHERE id = ?", (batch_id,))
        return None if row is None else row[0]

    def release_batch(self, batch_id, owner):
        self._exec("UPDATE batches SET owner = NULL WHERE id = ? AND owner = ?",
                   (batch_id, owner))

    def put_batch_result(self, batch_id, result):
        return self._exec("INSERT INTO batch_results (batch_id, line, is_error, body) VALUES "
                          "(?, ?, ?, ?) ON CONFLICT (batch_id, line) DO NOTHING",
                          (batch_id, result.line, int(result.is_error),
                           _dumps(result.body))) == 1

    def batch_results(self, batch_id):
        rows = self._query("SELECT line, is_error, body FROM batch_results WHERE batch_id = ? "
                           "ORDER BY line", (batch_id,))
        return [BatchResult(int(line), bool(err), json.loads(body)) for line, err, body in rows]

    def finish_batch(self, body, files, owner):
        with self._transaction() as execute:
            cur = execute("UPDATE batches SET status = ?, body = ?, owner = NULL WHERE id = ? "
                          "AND owner = ?", (body["status"], _dumps(body), body["id"], owner))
            if cur.rowcount != 1:
                return False
            for meta, content in files:
                self._insert_file(execute, meta, content)
        return True


class SQLiteStateStore(SQLStateStore):
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
        self._db.executescript(_SCHEMA.format(bytes="BLOB"))

    def _query(self, sql, args=()):
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _exec(self, sql, args=()):
        with self._lock:
            return self._db.execute(sql, args).rowcount

    @contextmanager
    def _transaction(self) -> Iterator[Execute]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # the write lock now: no upgrade deadlock
            try:
                yield self._db.execute
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self):
        with self._lock:
            self._db.close()


def default_state_store_url() -> str:
    """sqlite:/// + $SERVELM_HOME/state.sqlite3 (the model cache's home)."""
    from servelm.loader.model_cache import cache_home

    return f"sqlite:///{cache_home() / 'state.sqlite3'}"


_SCHEMES = ("sqlite", "postgresql", "postgres")


def state_store_scheme(url: str | None) -> str:
    """"sqlite" or "postgresql" for a `--state-store` URL (None: the default file); a
    ValueError naming the flag for any other URL (checked at start-up)."""
    url = url or default_state_store_url()
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+")[0] not in _SCHEMES:
        raise ValueError(f"--state-store: unsupported URL {url!r} (expected sqlite:///PATH or "
                         "postgresql://USER@HOST/DB)")
    if scheme == "sqlite":
        state_store_path(url)
        return "sqlite"
    return "postgresql"


def state_store_path(url: str | None) -> str:
    """The SQLite file a `sqlite:///` URL names (None: the default file); a ValueError
    naming the flag for any other URL."""
    url = url or default_state_store_url()
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "sqlite":
        raise ValueError(f"--state-store: unsupported URL {url!r} (expected "
                         "sqlite:///PATH)")
    if not rest.startswith("/") or rest == "/":
        raise ValueError(f"--state-store: {url!r} names no file (expected sqlite:///PATH)")
    # As SQLAlchemy reads them: sqlite:///rel/path, sqlite:////abs/path, sqlite:///:memory:
    return rest[1:]


def check_state_store(url: str | None) -> None:
    """At start-up: a ValueError naming the flag for a URL servelm cannot use, or a
    PostgreSQL server it cannot reach (a SQLite file is created when first used)."""
    if state_store_scheme(url) == "postgresql":
        open_state_store(url).close()


def open_state_store(url: str | None, lease_s: float = DEFAULT_LEASE_S) -> StateStore:
    """The store a `--state-store` URL names (None: the default file)."""
    if state_store_scheme(url) == "postgresql":
        from servelm.server.state_store_postgres import PostgresStateStore

        return PostgresStateStore(url, lease_s=lease_s)
    return SQLiteStateStore(state_store_path(url), lease_s=lease_s)


__all__ = ["ACTIVE_BATCH_STATUSES", "ACTIVE_STATUSES", "BatchResult", "ItemPage",
           "SQLStateStore", "SQLiteStateStore", "StateStore", "TenantUsage",
           "check_state_store",
           "default_state_store_url",
           "open_state_store", "state_store_path", "state_store_scheme"]
