"""say_if_slow: a step that may stall a first run says what it is doing, once it is slow.

A first start does work that later ones skip (parsing a GGUF file's metadata, dequantizing
its weights, writing the caches, building the C++ kernels, pulling a model). Each takes
seconds to minutes, and silence for that long reads as a hang. A step wrapped in
`with say_if_slow("parsing X"):` logs "parsing X ..." once it has run SLOW_AFTER_S seconds
and "parsing X: done in 3.6 s" when it ends; a step that ends sooner says nothing, so quick
starts stay quiet.

Nested steps on one thread: an enclosing step stays quiet while an inner one is open (the
inner one says what is slow), and speaks once it has run SLOW_AFTER_S seconds with no inner
step open. So "reading the model's config" around "parsing the GGUF metadata" says only the
latter, unless the rest of the config read is slow too.

The lines go to the `servelm.slow_step` logger at INFO, a level it sets for itself: the
`servelm` command logs only warnings unless --verbose, and these lines must show anyway.

Owns: the timer and the nesting. Never: imports torch or anything of servelm (the C++
kernel build, servelm/cpu_kernels, uses it before anything else is loaded).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)
logger.setLevel(logging.INFO)  # shown under the CLI's default (warnings only): see above

SLOW_AFTER_S = 1.5

_lock = threading.Lock()  # every notice's state: the watcher threads and the step's own
_open = threading.local()  # .stack: this thread's open notices, innermost last


def _watch(after_s: float, fire: Callable[[], None]) -> Callable[[], None]:
    """Call `fire` on a daemon thread after `after_s` seconds; returns the cancel function
    (a test replaces this with a clock of its own)."""
    timer = threading.Timer(after_s, fire)
    timer.daemon = True
    timer.start()
    return timer.cancel


class _Notice:
    def __init__(self, what: str, after_s: float, parent: _Notice | None):
        self.what, self.after_s, self.parent = what, after_s, parent
        self.start = time.monotonic()
        self.num_open_inner = 0
        self.is_done = self.has_spoken = self.is_waiting_for_inner = False
        self.cancel = _watch(after_s, self.fire)

    def fire(self) -> None:
        """after_s have passed (on the watcher's thread)."""
        with _lock:
            if self.is_done or self.has_spoken:
                return
            if self.num_open_inner:
                self.is_waiting_for_inner = True  # the inner step speaks for now
                return
            self.has_spoken = True
            logger.info("%s ...", self.what)  # under the lock: before "done"

    def inner_closed(self) -> None:
        """An inner step ended: if this one had to hold back, it gets after_s more."""
        with _lock:
            self.num_open_inner -= 1
            rearm = self.is_waiting_for_inner and not self.num_open_inner
            self.is_waiting_for_inner = False
        if rearm:
            self.cancel = _watch(self.after_s, self.fire)


@contextlib.contextmanager
def say_if_slow(what: str, after_s: float = SLOW_AFTER_S) -> Iterator[None]:
    """Log `what` if the block is still running after `after_s` seconds, then how long it
    took when it ends; say nothing if it ends sooner. `what` says what the step does, e.g.
    "building servelm's C++ kernels (once per machine, 1-2 min)"."""
    stack = _open.__dict__.setdefault("stack", [])
    parent = stack[-1] if stack else None
    if parent is not None:
        with _lock:
            parent.num_open_inner += 1
    notice = _Notice(what, after_s, parent)
    stack.append(notice)
    try:
        yield
    finally:
        stack.pop()
        with _lock:
            notice.is_done = True
            spoke = notice.has_spoken
        notice.cancel()
        if spoke:
            logger.info("%s: done in %.1f s", what, time.monotonic() - notice.start)
        if parent is not None:
            parent.inner_closed()
