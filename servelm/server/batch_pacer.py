"""BatchPacer: how many seats a batch is owed, whatever waits in the engine's queue, so that
it finishes within its completion window.

Owns: one batch's measured line time (an exponential mean of the seconds a line takes from
submission to its result) and the rule that turns it, the lines left and the time left into
a minimum share of the runner's seats:

    line_s   = the measured mean (before any line has finished: `prior_line_s`)
    share    = margin x lines_left x line_s / seconds_left     (seats, as a real number)
    owed     = min(max_seats, floor(share))

A batch whose `owed` seats are not all taken may submit a line even while interactive
requests wait in the engine's queue; beyond them it takes only idle capacity. With margin 2,
`floor(share)` seats finish the lines left in at most the time left (share in [1, 2): one
seat, lines_left x line_s < seconds_left; share >= 2: floor(share) >= share / 2), and a
batch with slack is owed nothing: while it waits, seconds_left shrinks and the share grows
until a seat is owed, so the share rises as the deadline nears and falls back as lines
finish. The lines are assumed to run side by side at about the speed of one (a batching
engine), so n seats finish n lines per line_s.
Never: reads a clock (the caller passes the time left), submits a line, or looks at the
engine: the runner does, and interactive traffic still goes first in the scheduler (a batch
line carries the lowest SLO class).
"""

from __future__ import annotations

import math


class BatchPacer:
    def __init__(self, prior_line_s: float, margin: float = 2.0, alpha: float = 0.2):
        if not prior_line_s > 0:
            raise ValueError(f"prior_line_s: must be > 0, got {prior_line_s!r}")
        if not margin >= 1:
            raise ValueError(f"margin: must be >= 1, got {margin!r}")
        self.margin = margin
        self.alpha = alpha
        self.line_s = prior_line_s
        self.num_measured = 0

    def observe(self, line_s: float) -> None:
        """A line took `line_s` seconds from submission to its result."""
        line_s = max(0.0, line_s)
        if self.num_measured == 0:
            self.line_s = line_s  # the prior is a guess: the first measurement replaces it
        else:
            self.line_s += self.alpha * (line_s - self.line_s)
        self.num_measured += 1

    def share(self, num_left: int, seconds_left: float) -> float:
        """The seats (a real number) that finish `num_left` lines in seconds_left / margin."""
        if num_left <= 0:
            return 0.0
        if seconds_left <= 0:
            return math.inf
        return self.margin * num_left * self.line_s / seconds_left

    def owed_seats(self, num_left: int, seconds_left: float, max_seats: int) -> int:
        """Seats the batch may fill even with a non-empty queue."""
        share = self.share(num_left, seconds_left)
        return max_seats if share >= max_seats else int(share)

    def line_rate(self, num_seats: int) -> float:
        """Lines a second that `num_seats` seats finish at the measured line time."""
        return num_seats / max(self.line_s, 1e-9)


__all__ = ["BatchPacer"]
