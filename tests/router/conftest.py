import sys
from pathlib import Path

# The HTTP test helpers (live_server.py) live with the server tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
