"""The processes `serve --data-parallel-size N` and `serve --disagg P:D` start, as launcher
specs: what each runs, where it listens, when it is ready; and a replica that cannot start
is reported with its own last words."""

from __future__ import annotations

import pytest

from servelm.launch import HttpHealth, LaunchError, Supervisor
from servelm.router.data_parallel import replica_spec, start_replicas, url_of
from servelm.router.disagg import worker_specs


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_a_replica_spec_serves_on_its_own_loopback_port_with_the_parents_flags():
    argv = ["MODEL", "--port", "8000", "--host", "0.0.0.0", "--data-parallel-size", "2",
            "--router-policy=session", "--max-num-seqs", "8"]
    spec = replica_spec(argv, 41234, threads=3)
    assert spec.name == "replica http://127.0.0.1:41234"
    assert spec.argv[1:4] == ("-m", "servelm.cli", "serve")
    run = list(spec.argv[4:])
    assert run[0] == "MODEL" and _flag(run, "--max-num-seqs") == "8"
    assert _flag(run, "--port") == "41234" and _flag(run, "--host") == "127.0.0.1"
    assert _flag(run, "--threads") == "3"
    assert "--data-parallel-size" not in run and not any("router-policy" in a for a in run)
    assert spec.readiness == HttpHealth("http://127.0.0.1:41234/health")


def test_disagg_worker_specs_name_their_roles_and_kv_addresses():
    specs, prefill, decode = worker_specs(["MODEL", "--disagg", "1:2", "--kv-transport", "shm"],
                                          1, 2, "tcp")
    assert len(prefill) == 1 and len(decode) == 2
    assert [s.name.split()[0] for s in specs] == ["prefill", "decode", "decode"]
    assert [s.name.split()[-1] for s in specs] == prefill + decode
    for spec in specs:
        run = list(spec.argv[4:])
        role = _flag(run, "--role")
        assert spec.name.startswith(f"{role} worker ")
        assert "--disagg" not in run and run.count("--kv-transport") == 1
        assert _flag(run, "--kv-transport") == "tcp"
        assert ("--kv-address" in run) == (role == "prefill")
    assert _flag(list(specs[0].argv), "--kv-address").startswith("tcp://127.0.0.1:")


def test_a_replica_that_cannot_start_is_reported_with_its_last_stderr_lines():
    supervisor = Supervisor(stop_at_exit=False)
    with pytest.raises(LaunchError) as info:
        start_replicas(supervisor, ["/nonexistent/model", "--engine-core", "thread"], 1)
    death = info.value.death
    assert death is not None and death.exit_code not in (None, 0)
    assert death.name.startswith("replica http://127.0.0.1:")
    assert any("/nonexistent/model" in line for line in death.stderr_tail)
    assert "while starting; last stderr lines:" in str(info.value)
    assert supervisor.handles == []


def test_url_of_a_replica_handle():
    class Handle:
        spec = replica_spec(["M"], 5, None)

    assert url_of(Handle()) == "http://127.0.0.1:5"
