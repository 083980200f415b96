"""The supervisor with tiny Python children: readiness, config on stdin, death reports,
health failures, stopping, and children that end with their parent but not with the thread
that started them. No timing is asserted: waits are on events, pipes and exit codes (the
generous timeouts below only keep a broken build from hanging the run)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from servelm.launch import (DEVNULL, INHERIT, TEE, TO_STDERR, Accepted, HttpHealth,
                            LaunchError, ProcessSpec, Resources, Supervisor, torchrun_env)

PY = sys.executable
HANG_GUARD_S = 120.0  # not a bound on speed: only so that a broken supervisor fails, not hangs

# An HTTP child: reads its JSON config from stdin, answers /health 503 for the first
# `not_ready_probes` probes, then 200 until someone GETs /sick; /config echoes the config
# and its environment's SERVELM_TEST_VAR.
HTTP_CHILD = textwrap.dedent("""
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    config = json.loads(sys.stdin.read())
    state = {"probes": 0, "sick": False}
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            if self.path == "/health":
                state["probes"] += 1
                ok = state["probes"] > config["not_ready_probes"] and not state["sick"]
                self._send(200 if ok else 503, {"probes": state["probes"]})
            elif self.path == "/sick":
                state["sick"] = True
                self._send(200, {})
            else:
                self._send(200, {"config": config,
                                 "var": os.environ.get("SERVELM_TEST_VAR")})
        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
    HTTPServer(("127.0.0.1", config["port"]), H).serve_forever()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sup():
    s = Supervisor(stop_at_exit=False)
    yield s
    s.stop_all(5.0)


def _http_spec(port: int, not_ready_probes: int = 2, **kw) -> ProcessSpec:
    config = json.dumps({"port": port, "not_ready_probes": not_ready_probes}).encode()
    return ProcessSpec(f"http child :{port}", (PY, "-c", HTTP_CHILD), config=config,
                       readiness=HttpHealth(f"http://127.0.0.1:{port}/health"), **kw)


def test_start_waits_for_readiness_and_hands_over_config_and_env(sup):
    port = _free_port()
    spec = _http_spec(port, not_ready_probes=3,
                      resources=Resources(env={"SERVELM_TEST_VAR": "hello"}))
    handle = sup.start(spec)
    assert handle.is_alive
    # start() returned only after a 200: the child counted more probes than it refused
    assert httpx.get(f"http://127.0.0.1:{port}/health").json()["probes"] > 4
    body = httpx.get(f"http://127.0.0.1:{port}/config").json()
    assert body == {"config": {"port": port, "not_ready_probes": 3}, "var": "hello"}


def test_death_while_starting_reports_exit_code_and_last_stderr_lines(sup):
    script = "import sys; print('loading', file=sys.stderr); " \
             "print('ValueError: model_path: no such file', file=sys.stderr); sys.exit(3)"
    spec = ProcessSpec("replica A", (PY, "-c", script), stderr=DEVNULL,
                       readiness=HttpHealth(f"http://127.0.0.1:{_free_port()}/health"))
    with pytest.raises(LaunchError) as info:
        sup.start(spec)
    death = info.value.death
    assert death.exit_code == 3 and death.signal_name is None and death.name == "replica A"
    assert death.stderr_tail[-2:] == ("loading", "ValueError: model_path: no such file")
    message = str(info.value)
    assert "replica A" in message and "exited with code 3 while starting" in message
    assert "ValueError: model_path: no such file" in message


def test_killed_by_a_signal_is_named(sup):
    handle = sup.start(ProcessSpec("victim", (PY, "-c", "import time; time.sleep(600)")))
    os.kill(handle.pid, signal.SIGKILL)
    death = handle.death(settle_s=HANG_GUARD_S)
    assert death.exit_code is None and death.signal_name == "SIGKILL"
    assert death.describe().startswith(f"victim (pid {handle.pid}) killed by SIGKILL")


def test_missing_the_readiness_deadline_stops_it(sup):
    spec = ProcessSpec("sleeper", (PY, "-c", "import time; time.sleep(600)"),
                       readiness=HttpHealth(f"http://127.0.0.1:{_free_port()}/health"),
                       ready_timeout_s=0.3)
    with pytest.raises(LaunchError, match=r"sleeper not ready in 0.3 s \(waiting for GET"):
        sup.start(spec)
    assert sup.handles == []


def test_start_all_stops_the_others_when_one_dies(sup, tmp_path):
    pid_file = tmp_path / "ok.pid"
    ok = ProcessSpec("ok", (PY, "-c", f"import os, time; open({str(pid_file)!r}, 'w')"
                            ".write(str(os.getpid())); time.sleep(600)"),
                     readiness=FileExists(pid_file))
    bad = ProcessSpec("bad", (PY, "-c", "raise SystemExit(5)"),
                      readiness=HttpHealth(f"http://127.0.0.1:{_free_port()}/health"))
    with pytest.raises(LaunchError, match="bad .* exited with code 5"):
        sup.start_all([ok, bad])
    assert sup.handles == []
    assert not _alive(int(pid_file.read_text()))


class FileExists:
    """A readiness condition of the test's own: any object with `what` and `check()`."""

    def __init__(self, path):
        self.path, self.what = path, f"{path}"

    def check(self) -> bool:
        return self.path.exists() and self.path.read_text() != ""


def test_watch_reports_a_death_once_and_not_a_stop(sup):
    deaths, seen = [], threading.Event()

    def on_death(death):
        deaths.append(death)
        seen.set()

    stopped = sup.start(ProcessSpec("stopped", (PY, "-c", "import time; time.sleep(600)")))
    dying = sup.start(ProcessSpec(
        "dying", (PY, "-c", "import sys, time; print('out of memory', file=sys.stderr); "
                  "sys.stderr.flush(); time.sleep(600)"), stderr=DEVNULL))
    watch = sup.watch(on_death, interval_s=0.05)
    try:
        stopped.stop(grace_s=HANG_GUARD_S)
        while "out of memory" not in dying.stderr_tail():
            dying.death(settle_s=0.05)
        os.kill(dying.pid, signal.SIGKILL)
        assert seen.wait(HANG_GUARD_S)
    finally:
        watch.stop()
    assert [(d.name, d.signal_name) for d in deaths] == [("dying", "SIGKILL")]
    assert deaths[0].stderr_tail == ("out of memory",)


def test_watch_reports_failed_health_checks(sup):
    port = _free_port()
    handle = sup.start(_http_spec(port, not_ready_probes=0))
    unhealthy, seen = [], threading.Event()

    def on_unhealthy(h, n):
        unhealthy.append((h, n))
        seen.set()

    watch = sup.watch(lambda d: None, on_unhealthy, interval_s=0.05, unhealthy_after=2)
    try:
        httpx.get(f"http://127.0.0.1:{port}/sick")
        assert seen.wait(HANG_GUARD_S)
    finally:
        watch.stop()
    assert unhealthy[0][0] is handle and unhealthy[0][1] >= 2


def test_stop_ends_the_process_group_with_new_session(sup):
    # the child starts a grandchild and reports its pid; stopping the child's group ends both
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              "print(p.pid, flush=True); time.sleep(600)")
    r, w = os.pipe()
    handle = sup.start(ProcessSpec("group", (PY, "-c", script), new_session=True,
                                   parent_death_signal=None, stdout=f"/dev/fd/{w}"))
    os.close(w)
    with os.fdopen(r) as out:
        grandchild = int(out.readline())
        handle.stop(grace_s=HANG_GUARD_S)
        assert select.select([out], [], [], HANG_GUARD_S)[0]
        assert out.read() == ""  # EOF: the grandchild, the pipe's last writer, has gone
    assert _gone(grandchild)


def _gone(pid: int) -> bool:
    """A process that closed its files is on its way out: wait for it to be a zombie or
    reaped (the guard only ends a wait that would never end)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_child_dies_with_its_parent():
    """A parent (started here) uses the supervisor to start a child, prints the child's pid
    and is SIGKILLed: the child gets its parent-death signal. Its stdout is the pipe read
    here, so EOF means the child has gone."""
    script = textwrap.dedent(f"""
        import sys, time
        from servelm.launch import ProcessSpec, Supervisor
        h = Supervisor().start(ProcessSpec("child", ({PY!r}, "-c",
                                           "import time; time.sleep(600)")))
        print(h.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait()
        assert select.select([parent.stdout], [], [], HANG_GUARD_S)[0]
        assert parent.stdout.read() == ""
        assert _gone(child)
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()


def test_child_outlives_the_thread_that_started_it(sup, tmp_path):
    """PR_SET_PDEATHSIG fires when the forking *thread* ends; the supervisor forks from a
    thread of its own, so a child started from a short-lived thread lives on."""
    ready = tmp_path / "ready"
    script = ("import signal, sys, time; "
              "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(0)); "
              f"open({str(ready)!r}, 'w').write('1'); time.sleep(600)")
    spec = ProcessSpec("survivor", (PY, "-c", script), parent_death_signal=signal.SIGKILL,
                       readiness=FileExists(ready))
    started, tid = [], []

    def start():
        tid.append(threading.get_native_id())
        started.append(sup.start(spec))

    t = threading.Thread(target=start)
    t.start()
    t.join()
    while os.path.exists(f"/proc/self/task/{tid[0]}"):  # the OS thread, not just Python's
        t.join(0.01)
    handle = started[0]
    os.kill(handle.pid, signal.SIGUSR1)
    assert handle.death(settle_s=HANG_GUARD_S).returncode == 0  # -9 had the thread killed it


def test_output_to_a_file_with_stdout_merged(sup, tmp_path):
    log = tmp_path / "child.log"
    script = "import sys; print('to stdout', flush=True); print('to stderr', file=sys.stderr)"
    handle = sup.start(ProcessSpec("logged", (PY, "-c", script), stdout=TO_STDERR,
                                   stderr=str(log)))
    assert handle.death(settle_s=HANG_GUARD_S).returncode == 0
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]


def test_each_stderr_line_reaches_the_callback_and_the_log(sup, tmp_path):
    log = tmp_path / "child.log"
    lines, last = [], threading.Event()

    def on_line(line: str) -> None:
        lines.append(line)
        if line == "three":  # the last one, without a newline: given at EOF
            last.set()

    script = ("import sys, time; sys.stderr.write('one\\ntw'); sys.stderr.flush(); "
              "time.sleep(0.05); sys.stderr.write('o\\n\\nthree')")
    sup.start(ProcessSpec("talker", (PY, "-c", script), stderr=str(log),
                          on_stderr_line=on_line))
    assert last.wait(HANG_GUARD_S)
    assert lines == ["one", "two", "", "three"]
    assert log.read_text() == "one\ntwo\n\nthree"


def test_a_failing_line_callback_still_drains_the_pipe(sup, tmp_path):
    """A callback that raises gets no more lines, but the child's output still flows: more
    than a pipe's buffer of it, which would block the child if nobody read it."""
    log = tmp_path / "child.log"
    calls = []

    def on_line(line: str) -> None:
        calls.append(line)
        raise RuntimeError("a broken callback")

    script = "import sys\nfor _ in range(3000):\n    sys.stderr.write('x' * 99 + '\\n')"
    handle = sup.start(ProcessSpec("verbose", (PY, "-c", script), stderr=str(log),
                                   on_stderr_line=on_line))
    assert handle.death(settle_s=HANG_GUARD_S).returncode == 0
    assert calls == ["x" * 99]


def test_cpus_pin_the_child(sup):
    cpu = sorted(os.sched_getaffinity(0))[-1]
    r, w = os.pipe()
    handle = sup.start(ProcessSpec(
        "pinned", (PY, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"),
        resources=Resources(cpus=(cpu,), num_threads=1), stdout=f"/dev/fd/{w}"))
    os.close(w)
    with os.fdopen(r) as out:
        assert out.read().strip() == f"[{cpu}]"
    assert handle.death(settle_s=HANG_GUARD_S).returncode == 0


def test_accepted_readiness_hands_over_the_connection(sup, tmp_path):
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    script = ("import socket, sys; s = socket.socket(socket.AF_UNIX); "
              f"s.connect({path!r}); s.sendall(b'hello'); s.recv(1)")
    ready = Accepted(listener)
    sup.start(ProcessSpec("connector", (PY, "-c", script), readiness=ready))
    assert ready.sock.recv(5) == b"hello"
    ready.sock.close()
    listener.close()


@pytest.mark.parametrize("bad, param", [
    (lambda: ProcessSpec("x", ()), "argv"),
    (lambda: ProcessSpec("x", ("true",), ready_timeout_s=0), "ready_timeout_s"),
    (lambda: ProcessSpec("x", ("true",), ready_poll_s=0), "ready_poll_s"),
    (lambda: ProcessSpec("x", ("true",), stderr=INHERIT, on_stderr_line=print),
     "on_stderr_line"),
    (lambda: Resources(num_threads=0), "num_threads"),
    (lambda: Resources(cpus=(-1,)), "cpus"),
    (lambda: torchrun_env(2, 2, "h", 1), "rank"),
])
def test_bad_specs_name_the_parameter(bad, param):
    with pytest.raises(ValueError, match=param):
        bad()


def test_resources_environment():
    env = Resources(num_threads=4, gpu_ids=(1, 3), env={"A": "1"}, unset_env=("B",)).environ(
        {"B": "x", "C": "y"})
    assert env == {"C": "y", "OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "1,3", "A": "1"}
    assert torchrun_env(1, 2, "h", 29500, local_rank=1) == {
        "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500",
        "LOCAL_RANK": "1"}


@pytest.mark.parametrize("stderr, kept", [(TEE, True), (INHERIT, False)])
def test_stderr_reaches_ours_teed_with_its_tail_or_inherited_without(sup, capfd, stderr, kept):
    script = "import sys; print('a line of stderr', file=sys.stderr); sys.exit(1)"
    handle = sup.start(ProcessSpec("talker", (PY, "-c", script), stderr=stderr))
    death = handle.death(settle_s=HANG_GUARD_S)
    assert death.exit_code == 1
    assert death.stderr_tail == (("a line of stderr",) if kept else ())
    assert "a line of stderr" in capfd.readouterr().err


def test_at_once_is_ready_even_if_it_has_already_ended(sup):
    handle = sup.start(ProcessSpec("quick", (PY, "-c", "raise SystemExit(4)")))
    assert handle.death(settle_s=HANG_GUARD_S).exit_code == 4
