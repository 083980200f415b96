"""Layering: the packages a runner drives (models/, attention/, layers/) never import runner/.

The batch metadata and the KV cache live below them (servelm/attention/forward_batch.py,
kv_cache.py), so a model can be built and run by any runner: the torch runner, a draft
proposer, a pipeline stage, a parallel worker. Checked on the source (ast), lazy imports
inside functions included, so an import added anywhere in those packages fails here.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import servelm

ROOT = pathlib.Path(servelm.__file__).parent
BELOW_RUNNER = ("models", "attention", "layers")
FORBIDDEN = "servelm.runner"


def _imported_modules(path: pathlib.Path, root: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file; relative imports resolved to absolute
    (root: the servelm package directory the file is under)."""
    package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            # `from servelm import runner` names the package in the alias
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _runner_imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root.parent)}:{line} imports {module}"
            for line, module in _imported_modules(path, root)
            if module == FORBIDDEN or module.startswith(FORBIDDEN + ".")]


@pytest.mark.parametrize("package", BELOW_RUNNER)
def test_package_never_imports_the_runner(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources found under servelm/{package}"
    offenders = [hit for path in files for hit in _runner_imports(path)]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("source", [
    "from servelm.runner.model_runner import build_forward_batch\n",
    "import servelm.runner.kv_cache\n",
    "from servelm import runner\n",
    "def f():\n    from ..runner import cuda_graph\n",
])
def test_the_check_catches_each_form_of_import(tmp_path, source):
    fake_root = tmp_path / "servelm"
    (fake_root / "models").mkdir(parents=True)
    path = fake_root / "models" / "family.py"
    path.write_text(source)
    assert _runner_imports(path, fake_root)


def test_the_check_passes_an_attention_import(tmp_path):
    fake_root = tmp_path / "servelm"
    (fake_root / "models").mkdir(parents=True)
    path = fake_root / "models" / "family.py"
    path.write_text("from servelm.attention.forward_batch import ForwardBatch\n"
                    "from ..layers import norm\n")
    assert not _runner_imports(path, fake_root)
