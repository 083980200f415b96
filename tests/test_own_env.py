"""The environment servelm chooses for itself at start-up (servelm/own_env.py)."""

import os
import subprocess
import sys

import pytest

from servelm import own_env


@pytest.mark.parametrize("busy, value", [
    (None, own_env.SPIN_CONTESTED), (0.0, own_env.SPIN_IDLE), (0.2, own_env.SPIN_IDLE),
    (0.25, own_env.SPIN_CONTESTED), (1.0, own_env.SPIN_CONTESTED)])
def test_spincount_follows_the_cores_use_by_others(busy, value):
    chosen, why = own_env.choose_spincount(busy)
    assert chosen == value
    assert ("idle" in why) == (value == own_env.SPIN_IDLE)


def test_a_busy_process_on_the_usable_cores_is_seen():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        own_env.busy_cores(0.3)  # let it start
        busy = own_env.busy_cores(0.3)
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and busy >= 0.5
    assert own_env.choose_spincount(busy)[0] == own_env.SPIN_CONTESTED


def _env_after(argv: list[str], **extra) -> str:
    """GOMP_SPINCOUNT as `servelm ARGV` leaves it, and its reason line."""
    code = ("import os, sys; from servelm import cli, own_env\n"
            "try: cli.main(sys.argv[1:])\nexcept SystemExit: pass\n"
            "print(os.environ.get('GOMP_SPINCOUNT'), own_env.startup_line(), sep='|')")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", own_env.CHOICE_VAR)}
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         env=env, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_engine_commands_set_the_spincount_and_say_why():
    value, line = _env_after(["serve", "--help"]).split("|")
    assert value in (own_env.SPIN_IDLE, own_env.SPIN_CONTESTED)
    assert line.startswith(f"environment: GOMP_SPINCOUNT={value} (")


def test_commands_without_an_engine_and_the_users_setting_are_left_alone():
    assert _env_after(["plan", "--help"]) == "None|None"
    assert _env_after(["serve", "--help"], GOMP_SPINCOUNT="77") == "77|None"


def test_a_child_process_logs_its_parents_choice():
    code = ("import os, subprocess, sys; from servelm import own_env; own_env.apply_defaults(); "
            "print(subprocess.run([sys.executable, '-c', 'from servelm import own_env; "
            "print(own_env.startup_line())'], capture_output=True, text=True).stdout.strip())")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", own_env.CHOICE_VAR)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.strip()
    assert out.startswith("environment: GOMP_SPINCOUNT=") and "SERVELM" not in out
