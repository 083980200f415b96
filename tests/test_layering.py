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


# -- the package layers ------------------------------------------------------------------------
# Each package (a subpackage of servelm, or a top-level module) sits in one layer, lowest
# first; an import may go to its own layer or any layer below, never up, and the package
# graph has no cycles (docs/architecture.md, "Layers"). Lazy imports inside functions count:
# they are the ones that tie packages into a knot without anyone noticing.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("foundation", frozenset({"protocol", "slow_step", "startup", "own_env", "tracing", "home",
                              "launch", "parsers", "sampling", "vision"})),
    ("config", frozenset({"config", "cost", "slo", "planner"})),
    ("contract", frozenset({"core"})),
    ("engine", frozenset({"engine"})),
    ("kernels", frozenset({"cpu_kernels", "kernels"})),
    ("quant", frozenset({"quant"})),
    ("layers", frozenset({"layers", "attention"})),
    ("models", frozenset({"models", "loader", "lora", "structured", "dtype_choice"})),
    ("runner", frozenset({"runner", "spec", "parallel", "disagg", "kv_tiers"})),
    ("assembly", frozenset({"engine_builder", "llm", "core_process"})),
    ("services", frozenset({"server", "router", "autoscale", "serve"})),
    ("tools", frozenset({"sim", "bench", "evals", "doctor", "cli", "spec_tools",
                         "quant_tools"})),
)

# The imports that still break the rule (upward, or closing a cycle inside a layer), each
# with why it is there. The list only shrinks: an entry whose import is gone fails
# test_known_exceptions_still_exist, so it is deleted when its import is.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _unit(module: str, root: pathlib.Path) -> str | None:
    """The package a module belongs to: servelm.X.Y -> X; None outside servelm and for the
    servelm package itself (its __init__ is the public facade, not a layer)."""
    parts = module.split(".")
    if parts[0] != "servelm" or len(parts) == 1:
        return None
    name = parts[1]
    if (root / name).is_dir() or (root / f"{name}.py").exists():
        return name
    return None  # `from servelm import LLM`: a name from the facade


def package_graph(root: pathlib.Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package pairs -> the import sites, every .py under root."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        parts = rel.with_suffix("").parts
        source = _unit(".".join(parts[:-1] if parts[-1] == "__init__" else parts), root)
        for line, module in _imported_modules(path, root):
            target = _unit(module, root)
            if source and target and target != source:
                edges.setdefault((source, target), []).append(f"{rel}:{line} {module}")
    return edges


def _layer_of(package: str) -> int:
    for rank, (_, members) in enumerate(LAYERS):
        if package in members:
            return rank
    raise AssertionError(f"servelm/{package} is in no layer: add it to LAYERS")


def cycles(pairs) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in pairs:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while component[-1:] != [v]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _upward(edges, known=KNOWN_EXCEPTIONS) -> list[str]:
    return [f"{a} ({LAYERS[_layer_of(a)][0]}) imports {b} ({LAYERS[_layer_of(b)][0]}): "
            f"{sites[0]}" for (a, b), sites in sorted(edges.items())
            if _layer_of(b) > _layer_of(a) and (a, b) not in known]


def test_every_package_has_a_layer():
    packages = {_unit(f"servelm.{p.stem}", ROOT) for p in ROOT.iterdir()
                if p.suffix == ".py" or (p / "__init__.py").exists()}
    for package in sorted(packages - {None, "__init__"}):
        _layer_of(package)


def test_no_package_imports_a_higher_layer():
    offenders = _upward(package_graph())
    assert not offenders, "\n".join(offenders)


def test_no_cycles_between_packages():
    edges = package_graph()
    remaining = cycles(pair for pair in edges if pair not in KNOWN_EXCEPTIONS)
    detail = [f"{a} -> {b}: {edges[a, b][0]}" for component in remaining
              for a in component for b in component if (a, b) in edges]
    assert not remaining, f"cycles {remaining}\n" + "\n".join(detail)


def test_known_exceptions_still_exist():
    edges = package_graph()
    gone = [pair for pair in KNOWN_EXCEPTIONS if pair not in edges]
    assert not gone, f"imports gone: delete {gone} from KNOWN_EXCEPTIONS"


def test_the_graph_finds_a_lazy_cycle(tmp_path):
    root = tmp_path / "servelm"
    for package, source in (("engine", "from servelm.sim import trace\n"),
                            ("sim", "def f():\n    from ..engine import engine\n")):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / "mod.py").write_text(source)
    edges = package_graph(root)
    assert set(edges) == {("engine", "sim"), ("sim", "engine")}
    assert cycles(edges) == [["engine", "sim"]]


def test_the_rule_catches_an_upward_import():
    edges = {("engine", "sim"): ["servelm/engine/x.py:1 servelm.sim"],
             ("sim", "engine"): ["servelm/sim/x.py:1 servelm.engine"]}
    assert _upward(edges, known={}) == [
        "engine (engine) imports sim (tools): servelm/engine/x.py:1 servelm.sim"]
