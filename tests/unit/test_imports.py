"""The import graph of mrl and converters: no cycles, and imports that run downward through the layers only.

Layers (top to bottom; a package may import its own layer and the layers below, and no two packages may import
each other, whatever the layer):
    app      mrl.cli, mrl.app: parse commands, start Ray and the workers, wire checkpoints
    loops    mrl.algorithms: grpo, sft, evaluate, score, written against interfaces
    pieces   policy, inference, environments, data, checkpoint, logging, distributed
    model    mrl.model: the Megatron model of an HF config
    core     mrl.objectives (pure math), mrl.parallel, mrl.config, converters (name maps and layout transforms)
    platform mrl.cpu: what makes Megatron and vLLM run without CUDA (patches, kernels, stand-ins); imports no mrl
`converters` imports nothing from mrl; production code never imports mrl.testing. Every import counts, also one
inside a function; imports under `if TYPE_CHECKING:` (annotations only, never executed) do not.

`python tests/unit/test_imports.py` prints the graph of the top-level packages.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {
    "app": {"mrl.cli", "mrl.app"},
    "loops": {"mrl.algorithms"},
    "pieces": {"mrl.policy", "mrl.inference", "mrl.environments", "mrl.data", "mrl.checkpoint", "mrl.logging",
               "mrl.distributed"},
    "model": {"mrl.model"},
    "core": {"mrl.objectives", "mrl.parallel", "mrl.config", "converters"},
    "platform": {"mrl.cpu"},
}
ORDER = list(LAYERS)  # top first
TEST_HELPERS = "mrl.testing"


def module_files() -> dict[str, Path]:
    """Module name -> file of every module of mrl and converters (a package is its __init__)."""
    out = {}
    for path in [*ROOT.glob("mrl/**/*.py"), *ROOT.glob("converters/**/*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside `if TYPE_CHECKING:` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imported(name: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """The project modules one import statement names (`from pkg import sub` names the submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    return subs or ([base] if base in modules else [])


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (executed imports only)."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in skip:
                graph[name].update(m for m in _imported(name, path, node, modules) if m != name)
    return graph


def package_of(module: str) -> str:
    """The unit the layers are made of: `converters`, `mrl.cli` or `mrl.<package>`."""
    parts = module.split(".")
    return parts[0] if parts[0] == "converters" else ".".join(parts[:2])


def layer_of(package: str) -> str:
    for layer, packages in LAYERS.items():
        if package in packages:
            return layer
    raise AssertionError(f"{package} is in no layer: add it to LAYERS in {__file__}")


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for module, imported in graph.items():
        for other in imported:
            if package_of(other) != package_of(module):
                out[package_of(module)].add(package_of(other))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_imports_and_skips_type_checking(tmp_path):
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mrl.config\n"
              "def f():\n    from mrl.parallel import layout\n")
    tree = ast.parse(source)
    skip = _type_checking_lines(tree)
    modules = module_files()
    found = {m for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in skip
             for m in _imported("mrl.x", tmp_path / "x.py", node, modules)}
    assert found == {"mrl.parallel.layout"}


def test_no_module_import_cycles():
    assert cycles(import_graph()) == []


def test_no_package_import_cycles():
    assert cycles(package_graph(import_graph())) == []


def test_imports_run_downward_through_the_layers():
    wrong = []
    for package, imported in package_graph(import_graph()).items():
        if package == TEST_HELPERS:
            continue
        for other in imported:
            if other == TEST_HELPERS:
                wrong.append(f"{package} imports the test helpers {other}")
            elif ORDER.index(layer_of(other)) < ORDER.index(layer_of(package)):
                wrong.append(f"{package} ({layer_of(package)}) imports {other} ({layer_of(other)}), a layer above")
    assert wrong == []


def test_converters_import_nothing_from_mrl():
    graph = import_graph()
    assert {m: sorted(i) for m, i in graph.items() if m.startswith("converters")
            and any(x.startswith("mrl") for x in i)} == {}


def test_every_package_is_in_a_layer():
    for module in module_files():
        package = package_of(module)
        if package not in ("mrl", TEST_HELPERS):
            layer_of(package)


if __name__ == "__main__":
    for package, imported in sorted(package_graph(import_graph()).items(), key=lambda kv: ORDER.index(
            layer_of(kv[0])) if kv[0] not in ("mrl", TEST_HELPERS) else len(ORDER)):
        print(f"{package:18s} -> {', '.join(sorted(imported))}")
