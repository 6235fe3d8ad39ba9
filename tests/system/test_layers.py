"""The package shows its layers: imports point one way, no circles, no giant functions.

Judged from the source text (the import statements each module runs), not by importing
it: an import inside a function counts like one at the top, since it runs when that
function does. Only imports under ``if TYPE_CHECKING:`` are left out (they never run).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

import triton_offload

LIBRARY = Path(triton_offload.__file__).parent
REPOSITORY = LIBRARY.parent
# Folders installed under triton_offload but kept at the top of the repository.
MAPPED = {
    "triton_offload.kernels": REPOSITORY / "kernels",
    "triton_offload.bench": REPOSITORY / "bench",
}

#: Each layer may import its own modules and those of lower ranks only. verify and vllm
#: share a rank but are separate layers: neither imports the other.
LAYERS: dict[str, int] = {
    "triton_offload.planner": 0,
    "triton_offload.kernels": 1,
    "triton_offload.transfer": 2,
    "triton_offload.verify": 3,
    "triton_offload.vllm": 3,
    "triton_offload.bench": 4,
    "triton_offload.cli": 5,
}
MAX_FUNCTION_LINES = 150


def _module_files() -> dict[str, Path]:
    """Every module of the installed package: dotted name -> file (bench's pytest suites,
    which are not part of the package, left out)."""
    files: dict[str, Path] = {}
    roots = [("triton_offload", LIBRARY), *MAPPED.items()]
    for package, folder in roots:
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder)
            if package == "triton_offload.bench" and relative.parts[0] == "suites":
                continue
            parts = list(relative.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


MODULES = _module_files()


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in (
        "TYPE_CHECKING",
        "typing.TYPE_CHECKING",
    )


def _run_time_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if _type_checking_block(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _run_time_imports(node)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".")
    if MODULES.get(module, Path()).name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def package_imports(module: str) -> set[str]:
    """The modules of this package that ``module`` imports when it runs."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found: set[str] = set()
    for node in _run_time_imports(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            source = _resolve(module, node)
            names = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                for alias in node.names
            ]
        found.update(name for name in names if name in MODULES and name != module)
    return found


def external_imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found: set[str] = set()
    for node in _run_time_imports(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif node.level == 0 and node.module:
            found.add(node.module)
    return {name for name in found if not name.startswith("triton_offload")}


GRAPH = {module: package_imports(module) for module in MODULES}


def layer_of(module: str) -> str | None:
    if module == "triton_offload.__main__":
        return "triton_offload.cli"  # ``python -m triton_offload`` runs the CLI
    for layer in LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    return None  # the root facade (triton_offload itself)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_judge_finds_a_circle_and_an_upward_import() -> None:
    """The checks below can fail: a planted circle and a planted upward import are found."""
    planted = {**GRAPH, "triton_offload.planner.groups": {"triton_offload.planner.plan"}}
    assert ["triton_offload.planner.groups", "triton_offload.planner.plan"] in [
        c for c in _cycles(planted) if len(c) == 2
    ] or any({"triton_offload.planner.groups", "triton_offload.planner.plan"} <= set(c)
             for c in _cycles(planted))  # fmt: skip
    assert _upward({"triton_offload.planner.plan": {"triton_offload.transfer.engine"}}) == [
        "triton_offload.planner.plan -> triton_offload.transfer.engine"
    ]


def test_every_module_belongs_to_a_layer() -> None:
    assert [m for m in MODULES if layer_of(m) is None] == ["triton_offload"]


def test_no_import_circle() -> None:
    assert _cycles(GRAPH) == []


def _upward(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        source = layer_of(module)
        for target in sorted(targets):
            layer = layer_of(target)
            if source is None or layer is None or layer == source:
                continue
            if LAYERS[layer] >= LAYERS[source]:
                wrong.append(f"{module} -> {target}")
    return wrong


def test_imports_point_down_the_layers() -> None:
    """cli -> bench -> vllm | verify -> transfer -> kernels -> planner; never upward, and
    vllm and verify never import each other."""
    assert _upward(GRAPH) == []


def test_the_root_facade_imports_nothing_when_it_runs() -> None:
    """``import triton_offload`` stays cheap: its names resolve on first use."""
    assert GRAPH["triton_offload"] == set()
    assert external_imports("triton_offload") <= {"__future__", "importlib", "typing"}


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if layer_of(m) == "triton_offload.planner")
)
def test_planner_imports_neither_torch_nor_triton(module: str) -> None:
    heavy = {n for n in external_imports(module) if n.split(".")[0] in ("torch", "triton", "numpy")}
    assert heavy == set()


#: Bench modules that time vLLM's own copy functions as baselines (imported only when
#: vllm is, and reported unavailable otherwise); they integrate nothing.
VLLM_BASELINES = {"triton_offload.bench.harness", "triton_offload.bench.paths"}


def test_only_the_vllm_layer_imports_vllm() -> None:
    found = sorted(
        f"{module}: {name}"
        for module in MODULES
        if layer_of(module) != "triton_offload.vllm" and module not in VLLM_BASELINES
        for name in external_imports(module)
        if name == "vllm" or name.startswith("vllm.")
    )
    assert found == []


def test_kernels_are_called_by_the_triton_copier_and_the_bench_only() -> None:
    users = sorted(
        module
        for module, targets in GRAPH.items()
        if layer_of(module) != "triton_offload.kernels"
        and any(layer_of(t) == "triton_offload.kernels" for t in targets)
    )
    assert [m for m in users if layer_of(m) != "triton_offload.bench"] == [
        "triton_offload.transfer.copiers"
    ]


@pytest.mark.parametrize(
    "name",
    [
        "TritonOffloadingSpec",
        "TritonTieringOffloadingSpec",
        "TritonOffloadingConnector",
        "TritonOffloadingConnectorScheduler",
        "TritonOffloadingWorker",
    ],
)
def test_vllm_classes_are_module_level_classes(name: str) -> None:
    """A vLLM engineer finds each class by grep, subclasses and type-checks it: it is a
    class statement at the top of a module of triton_offload/vllm/, not a closure's."""
    pytest.importorskip("vllm", reason="the vLLM integration needs vllm installed")
    tv = importlib.import_module("triton_offload.vllm")
    cls = getattr(tv, name)
    source = Path(inspect.getsourcefile(cls) or "")
    assert source.parent == LIBRARY / "vllm"
    assert cls.__qualname__ == name and "<locals>" not in cls.__qualname__
    tree = ast.parse(source.read_text())
    assert name in [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert cls.__module__ == f"triton_offload.vllm.{source.stem}"


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_longer_than_150_lines() -> None:
    long = []
    for module, path in MODULES.items():
        for function in _functions(ast.parse(path.read_text())):
            lines = (function.end_lineno or function.lineno) - function.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{module}.{function.name}: {lines} lines")
    assert long == []
