"""say_if_slow (servelm/slow_step.py): a step slower than its threshold says what it is doing
and then how long it took, a quicker one says nothing; nested steps let the inner one speak.
The threshold's passing is an event here (a fake watcher the test fires, or a log line the
step waits for), never a sleep that assumes how fast the machine is."""

import logging
import threading

import pytest

from servelm import slow_step, startup
from servelm.slow_step import say_if_slow


class _Lines(logging.Handler):
    """The slow-step logger's messages, and an Event set at each one."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []
        self.arrived = threading.Event()

    def emit(self, record):
        self.messages.append(record.getMessage())
        self.arrived.set()


@pytest.fixture
def lines():
    handler = _Lines()
    slow_step.logger.addHandler(handler)
    yield handler
    slow_step.logger.removeHandler(handler)


@pytest.fixture
def clock(monkeypatch):
    """A fake watcher: the watches started, in order; fire(i) is after_s passing for the
    i-th (a cancelled one never fires)."""

    class Clock:
        def __init__(self):
            self.watches = []

        def watch(self, after_s, fire):
            entry = {"after_s": after_s, "fire": fire, "cancelled": False}
            self.watches.append(entry)
            return lambda: entry.update(cancelled=True)

        def fire(self, i):
            if not self.watches[i]["cancelled"]:
                self.watches[i]["fire"]()

    c = Clock()
    monkeypatch.setattr(slow_step, "_watch", c.watch)
    return c


def test_a_step_slower_than_the_threshold_says_what_it_does_then_its_time(lines):
    with say_if_slow("parsing the metadata", after_s=0.01):
        # the step lasts until its line is out: slower than the threshold on any machine
        assert lines.arrived.wait(60), "no line from a step past its threshold"
        assert lines.messages == ["parsing the metadata ..."]
    assert len(lines.messages) == 2
    assert lines.messages[1].startswith("parsing the metadata: done in ")


def test_a_step_that_ends_before_the_threshold_says_nothing(lines, clock):
    with say_if_slow("parsing the metadata"):
        pass
    assert clock.watches[0]["after_s"] == slow_step.SLOW_AFTER_S
    assert clock.watches[0]["cancelled"]
    clock.watches[0]["fire"]()  # a watcher that fires late anyway finds the step done
    assert lines.messages == []


def test_with_a_real_timer_a_quick_step_stays_quiet(lines):
    with say_if_slow("quick", after_s=3600):
        pass
    assert lines.messages == []


def test_an_outer_step_holds_back_while_an_inner_one_speaks(lines, clock):
    with say_if_slow("reading the config"):
        with say_if_slow("parsing the GGUF metadata"):
            clock.fire(0)  # the outer's threshold passes while the inner one is open
            assert lines.messages == []
            clock.fire(1)
            assert lines.messages == ["parsing the GGUF metadata ..."]
        # the inner one closed: the outer one gets the threshold again from now
        assert len(clock.watches) == 3
    assert lines.messages[1].startswith("parsing the GGUF metadata: done in ")
    assert len(lines.messages) == 2  # the outer ended within its new threshold: quiet


def test_an_outer_step_that_runs_on_after_its_inner_one_speaks(lines, clock):
    with say_if_slow("reading the config"):
        with say_if_slow("parsing the GGUF metadata"):
            clock.fire(0)
        assert lines.messages == []  # the inner one was quick: nothing said yet
        clock.fire(2)  # the outer one's renewed threshold passes
        assert lines.messages == ["reading the config ..."]
    assert lines.messages[1].startswith("reading the config: done in ")


def test_a_slow_start_up_stage_says_which_stage_it_is(lines, clock):
    timer = startup.StartupTimer()
    with timer.stage("weights_pack"):
        clock.fire(0)
    assert lines.messages[0] == (f"{startup.STAGE_DOING['weights_pack']} (start-up stage "
                                 "weights_pack) ...")
    assert "weights_pack" in timer.stages
    with timer.stage("config"):
        pass
    assert len(lines.messages) == 2  # a quick stage: only the slow one's two lines


def test_the_helper_imports_no_torch():
    """servelm/cpu_kernels may use it before torch is loaded."""
    import subprocess
    import sys

    code = "import sys, servelm.slow_step; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
