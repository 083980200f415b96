"""One model frame: every text family is a DecoderLM, the package has one Python loop that
runs decoder layers (DecoderLM.forward: the runner, drafts, pipeline stages and vision rows
all call it), and the runner chooses the C++ decode stack from the model's own description
(models/fast_path.py), never by importing the model classes. Checked on the source (ast)."""

from __future__ import annotations

import ast
import pathlib

import servelm
from servelm.models import families, get_model_class
from servelm.models.decoder import DecoderLM

ROOT = pathlib.Path(servelm.__file__).parent


def _layer_loops() -> list[str]:
    """file:line of every `for x in <...layers...>:` whose body calls x with four
    arguments (a decoder layer's (positions, x, residual, batch))."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for loop in ast.walk(tree):
            if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name)
                    and "layers" in ast.unparse(loop.iter)):
                continue
            for node in ast.walk(loop):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == loop.target.id and len(node.args) == 4):
                    found.append(f"{path.relative_to(ROOT.parent)}:{loop.lineno}")
    return found


def test_one_loop_over_decoder_layers():
    loops = _layer_loops()
    assert len(loops) == 1 and loops[0].startswith("servelm/models/decoder.py:"), loops


def test_every_text_family_is_the_decoder_frame():
    vision = {"qwen2_vl", "llava"}  # their language_model is one
    for arch in set(families()) - vision:
        assert issubclass(get_model_class(arch), DecoderLM), arch


def test_the_runner_never_imports_model_classes():
    for name in ("cpu_decode.py", "model_runner.py", "cuda_graph.py"):
        path = ROOT / "runner" / name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("servelm.models"), \
                    f"runner/{name}:{node.lineno} imports {node.module}"
