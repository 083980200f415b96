"""The processes `serve --data-parallel-size N` and `serve --disagg P:D` start, as launcher
specs: what each runs, where it listens, when it is ready; and a replica that cannot start
is reported with its own last words."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
from replica_reference import PARENT_FLAGS, parse, received, strip_flags

from servelm.launch import HttpHealth, LaunchError, Supervisor
from servelm.router.data_parallel import replica_options, replica_spec, start_replicas, url_of
from servelm.router.disagg import worker_specs


def _parse(argv: list[str]):
    return parse(argv)


def _received(spec, monkeypatch) -> dict:
    """What the replica's own `serve` makes of its command line and the options it was
    handed on stdin."""
    assert spec.argv[1:4] == ("-m", "servelm.cli", "serve")
    options = json.loads(spec.config)
    assert list(spec.argv[4:]) == [options["model"], "--options-from-stdin"]
    return received(options, monkeypatch)


def _edited_argv(argv: list[str], port: int, threads: int, drop=(), extra=()) -> dict:
    """What a replica got before options were handed over by value: the parent's argv with
    its own flags cut out and the replica's added (the reference the options must equal)."""
    out = strip_flags(strip_flags(argv, set(drop)), PARENT_FLAGS)
    out += ["--host", "127.0.0.1", "--port", str(port)]
    if not any(a.split("=", 1)[0] == "--threads" for a in argv):
        out += ["--threads", str(threads)]
    return vars(_parse(out + list(extra)))


ARGVS = [
    ["MODEL", "--port", "8000", "--host", "0.0.0.0", "--data-parallel-size", "2",
     "--router-policy=session", "--max-num-seqs", "8", "--allowed-image-hosts", "a.com,b.org",
     "--kv-cache-memory", "64MiB", "--no-log-requests", "--cpu-kernels", "torch",
     "--backend", "local", "--replica-cpus", "2", "--autoscale", "p.json"],
    ["other-model", "--threads", "1", "--data-parallel-size=3", "--max-model-len", "512",
     "--engine-core", "thread", "--served-model-name", "m", "--api-key", "k"],
]


@pytest.mark.parametrize("argv", ARGVS)
def test_a_replica_receives_the_options_an_edited_command_line_gave_it(argv, monkeypatch):
    spec = replica_spec(replica_options(_parse(argv), 41234, threads=3))
    assert spec.name == "replica http://127.0.0.1:41234"
    assert spec.readiness == HttpHealth("http://127.0.0.1:41234/health")
    assert _received(spec, monkeypatch) == _edited_argv(argv, 41234, 3)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_disagg_workers_receive_their_roles_and_kv_addresses(transport, monkeypatch):
    argv = ["MODEL", "--disagg", "1:2", "--kv-transport", "inproc", "--role", "decode",
            "--kv-address", "tcp://x:1", "--max-num-seqs", "4", "--port", "9000"]
    specs, prefill, decode = worker_specs(_parse(argv), 1, 2, transport)
    assert len(prefill) == 1 and len(decode) == 2
    assert [s.name for s in specs] == [f"prefill worker {prefill[0]}",
                                       *(f"decode worker {u}" for u in decode)]
    threads = max(1, (os.cpu_count() or 1) // 3)
    for spec, url in zip(specs, prefill + decode):
        got = _received(spec, monkeypatch)
        role = got["disagg_role"]
        extra = ["--role", role, "--kv-transport", transport]
        if role == "prefill":
            assert got["kv_address"].startswith(f"{transport}://")
            extra += ["--kv-address", got["kv_address"]]
        else:
            assert got["kv_address"] == _parse(["MODEL"]).kv_address
        port = int(url.rsplit(":", 1)[1])
        assert got == _edited_argv(argv, port, threads, drop=(
            "--disagg", "--role", "--kv-address", "--kv-transport"), extra=extra)


def test_an_unknown_option_is_refused_by_name(monkeypatch):
    from servelm.serve.cli import options_from_stdin

    monkeypatch.setattr(sys, "stdin", io.StringIO('{"no_such_option": 1}'))
    with pytest.raises(ValueError, match="'no_such_option' is not a serve option"):
        options_from_stdin(_parse(["MODEL", "--options-from-stdin"]))


def test_a_replica_that_cannot_start_is_reported_with_its_last_stderr_lines():
    supervisor = Supervisor(stop_at_exit=False)
    with pytest.raises(LaunchError) as info:
        start_replicas(supervisor, _parse(["/nonexistent/model", "--engine-core", "thread"]), 1)
    death = info.value.death
    assert death is not None and death.exit_code not in (None, 0)
    assert death.name.startswith("replica http://127.0.0.1:")
    assert any("/nonexistent/model" in line for line in death.stderr_tail)
    assert "while starting; last stderr lines:" in str(info.value)
    assert supervisor.handles == []


def test_url_of_a_replica_handle():
    class Handle:
        spec = replica_spec(replica_options(_parse(["M"]), 5, None))

    assert url_of(Handle()) == "http://127.0.0.1:5"


def test_a_replica_that_failed_is_reported_one_that_drained_is_not(capfd):
    import time

    from servelm.launch import ProcessSpec
    from servelm.router.data_parallel import report_deaths

    supervisor = Supervisor(stop_at_exit=False)
    drained, failed = (supervisor.start(ProcessSpec(name, (sys.executable, "-c", code)))
                       for name, code in (("replica A", "pass"),
                                          ("replica B", "raise SystemExit(3)")))
    for handle in (drained, failed):
        handle.death(settle_s=120.0)
    watch = report_deaths(supervisor, "data parallel")  # one pass sees A, then B
    deadline = time.monotonic() + 120.0  # only so that a broken watch fails, not hangs
    err = ""
    while "replica B" not in err and time.monotonic() < deadline:
        time.sleep(0.05)
        err += capfd.readouterr().err
    watch.stop()
    assert f"[servelm] data parallel: replica B (pid {failed.pid}) exited with code 3" in err
    assert "replica A" not in err
