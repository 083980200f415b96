"""A real PostgreSQL server for the state-store tests: the `pgserver` package's bundled
binaries (a PyPI wheel; no system package), started once per test session in a temporary
directory, and a fresh database per test (import the `postgres_url` fixture).

Skips only when the bundled server cannot start on this machine, saying why."""

from __future__ import annotations

import sys
import time
import uuid

import pytest


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory):
    try:
        import pgserver
    except ImportError:
        if sys.platform in ("linux", "darwin"):
            raise  # it is in the test extra: missing here is a broken set-up, not a skip
        pytest.skip(f"pgserver publishes no PostgreSQL binaries for {sys.platform}")
    import psycopg
    from pgserver import postgres_server as pg_module

    # pgserver gives `pg_ctl start -w` 10 s, which a loaded 2-core machine can exceed (the
    # tests' engine and other processes beside it): give it two minutes.
    pg_ctl = pg_module.pg_ctl
    pg_module.pg_ctl = lambda args, **kw: pg_ctl(args, **{**kw, "timeout": 120})
    pgdata = tmp_path_factory.mktemp("pgdata")
    for attempt in range(3):
        try:
            server = pgserver.get_server(pgdata, cleanup_mode="stop")
            psycopg.connect(server.get_uri(), connect_timeout=30).close()
            break
        except Exception as exc:  # noqa: BLE001 - the reason is the skip message
            if attempt == 2:
                pytest.skip(f"the bundled PostgreSQL server did not start on this machine "
                            f"in three tries: {type(exc).__name__}: {exc}")
            time.sleep(2)
    yield server
    server.cleanup()
    pg_module.pg_ctl = pg_ctl


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """postgresql://... of an empty database of its own."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_server.get_uri(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres_server.get_uri(name)
