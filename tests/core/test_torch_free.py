"""The engine and the step contract run without torch (the simulator and the front end
import them in processes that never load a model)."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = [
    "servelm.core.contract", "servelm.core.codec", "servelm.core.runner_state",
    "servelm.core_process.client", "servelm.core_process.process", "servelm.engine.engine",
    "servelm.engine.scheduler", "servelm.engine.block_manager", "servelm.engine.prefix_cache",
    "servelm.engine.sequence", "servelm.engine.detokenizer", "servelm.engine.engine_loop",
    "servelm.engine.async_engine", "servelm.protocol", "servelm.config", "servelm.cost",
    "servelm.engine.step_cost_model", "servelm.sim.runner", "servelm.sim.fleet", "servelm.sim.cli",
    "servelm.router.policies", "servelm.router.replicas", "servelm.router.app",
    "servelm.router.cli",
]

_PROGRAM = """
import importlib, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
for name in sys.argv[1:]:
    importlib.import_module(name)
# And the engine runs a request end to end on a torch-free runner.
sys.path.insert(0, "tests")
from fake_runner import make_engine
from servelm.protocol import EngineRequest, SamplingParams
engine = make_engine()
engine.add_request(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=4)))
out = []
while engine.has_unfinished:
    out += [t for d in engine.step() for t in d.token_ids]
assert len(out) == 4, out
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""


def test_engine_and_contract_import_and_run_without_torch():
    proc = subprocess.run([sys.executable, "-c", _PROGRAM, *TORCH_FREE], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_the_check_would_catch_an_import_of_torch():
    proc = subprocess.run([sys.executable, "-c", _PROGRAM, "servelm.runner.model_runner"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "import of torch halted" in proc.stderr
