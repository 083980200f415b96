import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# The HTTP test helpers (live_server.py) live with the server tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))


RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A one-node Ray cluster on loopback (`RAY_NUM_CPUS` of the test module, default 2),
    stopped after the module; a cluster left on the machine (by a test that was killed)
    holding the ports is stopped and the start tried once more."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_ADDRESS": ""}
    start = [RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
             "--num-cpus", str(getattr(request.module, "RAY_NUM_CPUS", 2)), "--num-gpus",
             "0", "--include-dashboard", "false", "--disable-usage-stats"]
    for _ in range(2):
        done = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            break
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
    else:
        raise RuntimeError(f"ray start failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
