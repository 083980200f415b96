"""Building the kernels: one builder at a time under an OS lock that goes with its holder,
a killed builder handing over at once (its compiler jobs ended), the prebuilt levels a wheel
carries and which one a CPU loads.

The lock tests build a one-op library (the same build path as the real one, a fraction of
its compile time) in a temporary directory.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from servelm import cpu_kernels
from servelm.cpu_kernels import build, prebuilt

TINY_OP = """
#include <ATen/ATen.h>
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x * 2; }
TORCH_LIBRARY(servelm_build_test, m) { m.def("twice", twice); }
"""

BUILD_AND_SERVE = textwrap.dedent("""
    import json, logging, sys
    from pathlib import Path
    import torch
    from servelm.cpu_kernels import build
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    job = json.loads(sys.argv[1])
    spec = build.BuildSpec(job["name"], tuple(job["sources"]), ("-O1",), Path(job["dir"]))
    library = build.ensure_built(spec, "the test library")
    torch.ops.load_library(str(library))
    print(torch.ops.servelm_build_test.twice(torch.ones(3)).tolist(), flush=True)
""")


def _start(job: dict, log: Path) -> subprocess.Popen:
    """The build-and-serve script; its stderr (the build's lines) goes to `log`."""
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-c", BUILD_AND_SERVE, json.dumps(job)],
                                stdout=subprocess.PIPE, stderr=err, text=True)


def _compiling(session: int) -> bool:
    """A compiler of the build's session is running."""
    for pid in build.session_members(session):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"cc1plus" in cmd or b"-c " in cmd.replace(b"\0", b" "):
            return True
    return False


def _wait_until(condition, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout  # a generous deadline on a wait, not a speed bound
    while not condition():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.05)


def test_a_builder_killed_mid_build_hands_over_to_the_waiter(tmp_path):
    source = tmp_path / "tiny_op.cpp"
    source.write_text(TINY_OP)
    job = {"name": "servelm_build_test", "sources": [str(source)], "dir": str(tmp_path / "b")}
    lock = tmp_path / "b.lock"
    builder = _start(job, tmp_path / "builder.log")

    def holder() -> dict:
        try:
            return json.loads(lock.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    _wait_until(lambda: "session" in holder() and _compiling(holder()["session"]),
                "the first builder's compiler running")
    session = holder()["session"]
    waiter_log = tmp_path / "waiter.log"
    waiter = _start(job, waiter_log)  # blocks on the lock while the first builder holds it
    _wait_until(lambda: "waiting for the test library, being built by process "
                f"{builder.pid}" in waiter_log.read_text(), "the waiter saying whom it waits for")
    assert _compiling(session)  # still mid-build
    os.kill(builder.pid, signal.SIGKILL)  # no cleanup of its own runs
    builder.wait()

    out, _ = waiter.communicate(timeout=600)
    err = waiter_log.read_text()
    assert waiter.returncode == 0, err
    assert out.strip() == "[2.0, 2.0, 2.0]"  # built by the waiter, and it serves
    assert "building the test library" in err
    assert not [pid for pid in build.session_members(session)  # its compiler was ended
                if build._works_in(pid, tmp_path / "b")]

    again = _start(job, tmp_path / "again.log")  # built now: loaded, not rebuilt
    out, _ = again.communicate(timeout=600)
    err = (tmp_path / "again.log").read_text()
    assert again.returncode == 0 and out.strip() == "[2.0, 2.0, 2.0]", err
    assert "building" not in err and "waiting" not in err


def test_a_failed_build_says_why_and_leaves_no_marker(tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    spec = build.BuildSpec("servelm_broken", (str(source),), (), tmp_path / "b")
    with pytest.raises(RuntimeError, match="failed .*full log"):
        build.ensure_built(spec, "the broken library")
    assert not spec.is_built
    assert "error" in (tmp_path / "b" / "build.log").read_text()


def test_partial_build_is_cleared_before_building(tmp_path):
    build_dir = tmp_path / "b"
    build_dir.mkdir()
    (build_dir / "half.o").write_text("truncated")
    build._clear_partial(build_dir)
    assert not list(build_dir.iterdir())


@pytest.mark.parametrize("level", list(build.LEVELS))
def test_each_level_is_a_target_the_compiler_takes(level, tmp_path):
    """The flags of every level compile, and turn on the macros the sources switch on."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = subprocess.run([compiler, *build.LEVELS[level].cflags, "-dM", "-E", "-x", "c++",
                          os.devnull], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    macros = {"avx2": "__AVX2__", "avx512": "__AVX512BW__", "avx512_bf16": "__AVX512BF16__",
              "amx": "__AMX_TILE__"}
    assert f"#define {macros[level]} 1" in out.stdout


def test_best_level_needs_every_flag_and_a_usable_probe():
    v3 = set(build.LEVELS["avx2"].needs)
    v4 = set(build.LEVELS["avx512"].needs)
    bf16 = set(build.LEVELS["avx512_bf16"].needs)
    amx = set(build.LEVELS["amx"].needs)
    yes = lambda name: True  # noqa: E731
    assert build.best_level(frozenset({"sse4_2", "avx"}), yes) is None
    assert build.best_level(frozenset(v3), yes) == "avx2"
    assert build.best_level(frozenset(v4 - {"avx512vl"}), yes) == "avx2"
    assert build.best_level(frozenset(bf16), yes) == "avx512_bf16"
    assert build.best_level(frozenset(amx), yes) == "amx"
    # AMX advertised but the probe found it unusable (no kernel permission): no AMX level
    assert build.best_level(frozenset(amx), lambda name: not name.startswith("amx")) \
        == "avx512_bf16"


def _manifest(directory: Path, levels: list[str], sources="abc", torch_version="9.9") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for level in levels:
        (directory / level).mkdir(exist_ok=True)
        (directory / level / f"servelm_cpu_kernels_{level}.so").write_text("")
    (directory / "manifest.json").write_text(json.dumps(
        {"torch": torch_version, "sources": sources, "levels": levels}))


def test_prebuilt_takes_the_newest_level_this_cpu_runs(tmp_path):
    _manifest(tmp_path, ["avx2", "avx512", "avx512_bf16", "amx"])
    assert prebuilt.find(tmp_path, "abc", "9.9", level="avx512_bf16")[1] == "avx512_bf16"
    assert prebuilt.find(tmp_path, "abc", "9.9", level="amx")[1] == "amx"
    assert prebuilt.find(tmp_path, "abc", "9.9", level="avx2")[1] == "avx2"
    _manifest(tmp_path / "old", ["avx2"])
    assert prebuilt.find(tmp_path / "old", "abc", "9.9", level="amx")[1] == "avx2"


def test_prebuilt_for_other_sources_or_torch_is_not_used(tmp_path):
    _manifest(tmp_path, ["avx2"])
    assert prebuilt.find(tmp_path, "other", "9.9", level="avx2") is None
    assert prebuilt.find(tmp_path, "abc", "2.0", level="avx2") is None
    assert prebuilt.find(tmp_path / "absent", "abc", "9.9", level="avx2") is None
    _manifest(tmp_path / "avx512only", ["avx512"])
    assert prebuilt.find(tmp_path / "avx512only", "abc", "9.9", level="avx2") is None


def test_a_process_without_its_own_build_loads_the_prebuilt_level(tmp_path):
    """A wheel's layout: this CPU's library stands in for its level's prebuilt one; a process
    whose home has no build loads it and never compiles."""
    library = Path(cpu_kernels.load() and cpu_kernels.native_spec().library)
    level = prebuilt.cpu_level()
    if level is None:
        pytest.skip("this CPU runs no prebuilt level")
    wheel = tmp_path / "prebuilt"
    (wheel / level).mkdir(parents=True)
    shutil.copy2(library, wheel / level / f"servelm_cpu_kernels_{level}.so")
    (wheel / "manifest.json").write_text(json.dumps(
        {"torch": torch.__version__, "sources": cpu_kernels._source_hash(), "levels": [level]}))
    code = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from servelm import cpu_kernels
        cpu_kernels.PREBUILT_DIR = Path({str(wheel)!r})
        ops = cpu_kernels.load()
        print(cpu_kernels.source(), ops.silu_and_mul(torch.zeros(1, 32)).shape)
    """)
    home = tmp_path / "home"
    env = dict(os.environ, SERVELM_HOME=str(home))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"prebuilt ({level}) torch.Size([1, 16])"
    assert not (home / "torch_extensions").exists()  # nothing was built
