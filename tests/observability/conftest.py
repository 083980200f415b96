"""Fixtures of the observability tests: live servers (tests/server/live_server.py) on the
default model or on a model-free engine (tests/fake_runner.py: the real scheduler)."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
for p in (TESTS, TESTS / "server"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
