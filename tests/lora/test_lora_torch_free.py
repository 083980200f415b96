"""The engine's side of LoRA (adapter checks, slots) and the server's metrics of it import
and run without torch, as the rest of engine/ and core/ do (the simulator, the front end)."""

import subprocess
import sys

from conftest import save_adapter

_PROGRAM = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from servelm.config import ModelConfig
from servelm.lora.slots import LoraSlots
from servelm.lora.adapter import read_adapter
import servelm.lora.metrics
config = ModelConfig("llama", 384, 64, 128, 2, 4, 2, 16, 1024)
slots = LoraSlots(1, 8, config)
entry = slots.register("a", sys.argv[1])
assert slots.acquire(entry.lora_id) == 0
assert slots.drain().slots == {0: entry.lora_id}
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""


def test_adapter_checks_and_slots_run_without_torch(base_hf, tmp_path):
    save_adapter(base_hf, tmp_path / "a", r=4)
    out = subprocess.run([sys.executable, "-c", _PROGRAM, str(tmp_path / "a")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
