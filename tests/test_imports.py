"""The import graph of specdec_fast and kernels: no cycles, training code imported only by training,
and kernels importing nothing of the engine (docs/ARCHITECTURE.md, "Layout": dependencies flow
one way).

Every import counts, those inside functions too: a lazy import only hides a cycle until the day
someone moves it to the top of the file.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = "specdec_fast.train"
KERNELS = "specdec_fast.kernels"


def module_files() -> dict[str, Path]:
    """Module name -> file; kernels/ installs as specdec_fast.kernels."""
    files = {}
    for top in ("specdec_fast", "kernels"):
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] == "kernels":
                parts.insert(0, "specdec_fast")
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (`from package import module` names the module,
    `from module import name` the module)."""
    graph = {}
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    prefix = package[: len(package) - node.level + 1]
                    base = ".".join(prefix + ([node.module] if node.module else []))
                else:
                    base = node.module
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    targets.add(name if name in files else base)
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph(module_files())
    assert "specdec_fast.heads.checkpoint" in graph and "specdec_fast.kernels.verify" in graph
    assert cycles(graph) == []


def test_only_training_imports_training():
    graph = import_graph(module_files())
    offenders = {
        module: sorted(t for t in targets if t.startswith(TRAIN))
        for module, targets in graph.items()
        if not module.startswith(TRAIN) and any(t.startswith(TRAIN) for t in targets)
    }
    assert offenders == {}


def test_kernels_import_nothing_of_the_engine():
    graph = import_graph(module_files())
    offenders = {
        module: sorted(t for t in targets if not t.startswith(KERNELS))
        for module, targets in graph.items()
        if module.startswith(KERNELS) and any(not t.startswith(KERNELS) for t in targets)
    }
    assert offenders == {}
