"""PostgresStateStore: the state store on a PostgreSQL server (`--state-store
postgresql://USER@HOST/DB`), for replicas on several machines.

Owns: one psycopg 3 connection (autocommit; a transaction per multi-statement write), the
translation of the shared statements' `?` placeholders, and the schema (BYTEA for bytes).
Never: holds state of its own: every statement is SQLStateStore's, so both stores behave
the same (the tests run one suite against both).

psycopg is an optional dependency (`pip install servelm[postgres]`); a missing driver is an
error naming the flag, raised when the store is opened (at start-up).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from servelm.server.state_store import _SCHEMA, DEFAULT_LEASE_S, Execute, SQLStateStore


def _pg(sql: str) -> str:
    # The shared statements hold no literal '?' or '%' (statuses are quoted constants).
    return sql.replace("?", "%s")


class PostgresStateStore(SQLStateStore):
    def __init__(self, url: str, lease_s: float = DEFAULT_LEASE_S, connect_timeout_s: int = 10):
        try:
            import psycopg
        except ImportError:
            raise ValueError("--state-store: a postgresql:// store needs psycopg 3 (pip "
                             "install 'servelm[postgres]')") from None
        self.lease_s = lease_s
        self._lock = threading.Lock()  # one connection, used from worker threads
        try:
            self._db = psycopg.connect(_plain_url(url), autocommit=True,
                                       connect_timeout=connect_timeout_s)
        except psycopg.Error as exc:
            raise ValueError(f"--state-store: cannot connect to {_redacted(url)}: "
                             f"{str(exc).strip()}") from None
        with self._lock, self._db.transaction():
            # Two replicas starting together would race on CREATE TABLE IF NOT EXISTS.
            self._db.execute("SELECT pg_advisory_xact_lock(7305521)")
            for statement in _SCHEMA.format(bytes="BYTEA").split(";"):
                if statement.strip():
                    self._db.execute(statement)

    def _query(self, sql, args=()):
        with self._lock:
            return self._db.execute(_pg(sql), args).fetchall()

    def _exec(self, sql, args=()):
        with self._lock:
            return self._db.execute(_pg(sql), args).rowcount

    @contextmanager
    def _transaction(self) -> Iterator[Execute]:
        with self._lock, self._db.transaction():
            yield lambda sql, args=(): self._db.execute(_pg(sql), args)

    def close(self):
        with self._lock:
            self._db.close()


def _plain_url(url: str) -> str:
    """postgresql+psycopg://... (SQLAlchemy's spelling) -> postgresql://..."""
    scheme, sep, rest = url.partition("://")
    return f"postgresql://{rest}" if sep else url


def _redacted(url: str) -> str:
    """The URL without its password, for error messages."""
    scheme, _, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if at and ":" in creds:
        creds = creds.split(":", 1)[0] + ":***"
    return f"{scheme}://{creds}{at}{host}"


__all__ = ["PostgresStateStore"]
