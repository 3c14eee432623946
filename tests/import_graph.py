"""The project's import graph and its circles, read from the source with `ast` (nothing imported).

Why a reader of our own: a circle is an import that runs before the module it needs has
finished, so what counts is every import statement that executes, at module level or inside a
function (a function-level import is a circle deferred, not removed). Imports under `if TYPE_CHECKING:`
never run, but they still say that a module knows one above it, so they count too unless
`runtime_only` (`--runtime`) leaves them out.

An edge `a -> b` means module `a` executes an import of project module `b`:
`import x.y.z` and `from x.y import z` name the deepest project module they reach (`x.y.z`
when it is a module, else `x.y`). The parent packages' `__init__` that such an import also runs
are not edges: a package that re-exports its submodules would otherwise be a circle with each.

A circle is a strongly connected component of more than one module (or a module importing
itself). Run as a script it prints each circle, largest first:

    python3 -m tests.import_graph            # refimpl and conformance
    python3 -m tests.import_graph conformance
    python3 -m tests.import_graph --runtime     # without `if TYPE_CHECKING:` imports
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("refimpl", "conformance")


def modules(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every module of `packages` below `root`, by dotted name (a package is its `__init__`)."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, runtime_only: bool) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement (anywhere, functions included; typing-only ones unless `runtime_only`)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if runtime_only and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def edges(mods: dict[str, Path], runtime_only: bool = False) -> dict[str, set[str]]:
    """`{module: {project modules it imports}}` (see the module docstring for what counts)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        targets: set[str] = set()
        for node in _imports(tree, runtime_only):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from x import y`: the module x.y if it is one, else x
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
        for target in targets:
            named = next((t for t in [target, *reversed(_parents(target))] if t in mods), None)
            if named is not None:
                graph[name].add(named)
    for name in graph:
        graph[name].discard(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, largest first (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0

    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
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
                        out.append(sorted(component))
    return sorted(out, key=lambda c: (-len(c), c))


def circle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the component's first module, as a readable witness."""
    members = set(component)
    start = component[0]
    seen = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while seen[path[-1]] is not None:
                        path.append(seen[path[-1]])
                    return [*reversed(path), start]
                if child not in seen:
                    seen[child] = node
                    nxt.append(child)
        frontier = nxt
    return component


def main(argv: list[str]) -> int:
    runtime_only = "--runtime" in argv
    packages = tuple(a for a in argv if a != "--runtime") or PACKAGES
    graph = edges(modules(ROOT, packages), runtime_only)
    found = circles(graph)
    kind = "runtime imports" if runtime_only else "imports, typing-only ones included"
    print(f"{len(found)} import circle(s) among {len(graph)} modules of {', '.join(packages)} ({kind})")
    for component in found:
        print(f"- {len(component)} modules: {' -> '.join(circle_path(graph, component))}")
        print(f"  members: {', '.join(component)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
