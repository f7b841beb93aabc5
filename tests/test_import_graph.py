"""The layering of model/, tasks/ and flows/, read from the source (ast, no imports): no import cycle, no
import that points up a layer, and neither model/ nor the training engine reaching Prefect or MLflow.

Every import counts, inside a function too: a lazy import that dodges a cycle is still the cycle. So does
the package an import passes through: importing `tasks.training.loss` from outside runs
`tasks/training/__init__.py` first, and with it whatever that imports.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"model": 0, "tasks": 1, "flows": 2}  # an import may point to its own layer or one below


def _modules() -> dict[str, Path]:
    modules = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _imported_names(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every absolute module name `module` imports, anywhere in its source (relative imports resolved):
    `from a import b` imports a.b when that is a module, else a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return names


@functools.cache
def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, the outside top-level packages each module imports)."""
    modules = _modules()
    edges: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for module, path in modules.items():
        names = _imported_names(module, path, modules)
        targets = {name for name in names if name in modules}
        # Importing a.b.c runs a/__init__ and a/b/__init__ first, unless `module` is already inside them.
        for target in list(targets):
            parts = target.split(".")
            for k in range(1, len(parts)):
                parent = ".".join(parts[:k])
                if parent in modules and not (module == parent or module.startswith(parent + ".")):
                    targets.add(parent)
        edges[module] = targets - {module}
        outside[module] = {name.split(".")[0] for name in names if name.split(".")[0] not in LAYERS}
    return edges, outside


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_cycle_in_model_tasks_flows() -> None:
    edges, _ = _graph()
    assert _cycles(edges) == []


def test_no_import_points_up_a_layer() -> None:
    edges, _ = _graph()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in edges.items()
        for target in targets
        if LAYERS[target.split(".")[0]] > LAYERS[module.split(".")[0]]
    )
    assert upward == []


def test_model_and_the_engine_reach_neither_prefect_nor_mlflow() -> None:
    edges, outside = _graph()
    for start in ("model", "tasks.training"):
        reached, todo = {start}, [start]
        while todo:
            for target in edges[todo.pop()] - reached:
                reached.add(target)
                todo.append(target)
        found = {f"{module} imports {package}" for module in reached for package in outside[module]}
        assert not {line for line in found if line.endswith((" prefect", " mlflow"))}, start
