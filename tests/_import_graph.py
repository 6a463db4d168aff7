"""The import graph of a Python package, read with ``ast`` (nothing is imported), and its circles.

Every import counts: top-level, inside functions (lazy), under ``if TYPE_CHECKING:``. An edge ``a -> b`` means module
``a`` names module ``b`` (or a name defined in ``b``) in an import statement; ``from pkg import name`` counts ``pkg``
and, when ``pkg.name`` is a module, ``pkg.name``. Edges to a module's own packages (``pkg.sub.mod`` importing
``pkg.sub``) and to the package root are left out: Python runs them first and they hold no state of their children.
Used by ``tests/test_import_graph.py``; ``../shared/tools/import_cycles.py`` is the same rule as a script.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    """``root/sub/mod.py`` -> ``root.sub.mod``; ``root/sub/__init__.py`` -> ``root.sub``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, me: str, is_pkg: bool) -> list[str]:
    """The dotted names an import statement names (relative imports made absolute)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        pkg = (me if is_pkg else me.rpartition(".")[0]).split(".")
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def module_imports(root: Path, path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports (each name resolved to the longest module it starts with)."""
    me = module_name(root, path)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        for name in _imported(node, me, path.name == "__init__.py"):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me and not me.startswith(name + ".") and name != root.name:
                out.add(name)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: the package modules it imports} for every ``.py`` file under the package directory ``root``."""
    files = sorted(root.rglob("*.py"))
    modules = {module_name(root, f) for f in files}
    return {module_name(root, f): module_imports(root, f, modules) for f in files}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that reach each other (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def shortest_circle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """One circle through the group's first module, in import order, shortest first: [a, b, ..., a]."""
    inside, start = set(group), group[0]
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w not in inside:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return [start]


def circles(graph: dict[str, set[str]]) -> list[str]:
    """One line per import circle: the modules in import order (``a -> b -> a``), then every tie inside the group."""
    lines = []
    for group in strongly_connected(graph):
        ties = ", ".join(f"{a} -> {b}" for a in group for b in sorted(graph[a]) if b in group)
        lines.append(f"{' -> '.join(shortest_circle(graph, group))}   (all ties: {ties})")
    return lines


def forwarding_getattr(root: Path) -> list[str]:
    """Modules with a module-level ``__getattr__`` (PEP 562): the way a split re-exports names it moved away, and an
    import the graph cannot see. One line per module, with its line number."""
    out = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.parse(f.read_text(), str(f)).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "__getattr__":
                out.append(f"{module_name(root, f)} (line {node.lineno})")
    return out
