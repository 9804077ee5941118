"""Check halopipe's import graph: no cycles, and the core never imports ``halopipe.distributed``.

Reads every module under ``halopipe/`` with :mod:`ast` (nothing is imported or
run) and collects the halopipe modules each one imports, wherever the import
statement sits: an import inside a function still ties the two modules
together, it only hides the tie until run time. Imports under
``if TYPE_CHECKING:`` are skipped (they never run). ``from pkg import name``
counts as importing ``pkg.name`` when that is a module, else ``pkg``. Importing
``a.b.c`` from outside package ``a.b`` also runs ``a.b``'s ``__init__``, so that
is an edge too (the root package's ``__init__``, which re-exports the API, is not).

Rules (exit status 1 and one line per violation when broken):

* no cycle among halopipe modules;
* no core module imports ``halopipe.distributed`` or anything under it. The
  core is the single-process library every other layer builds on:
  :data:`CORE`.

Usage: ``python scripts/check_imports.py [path/to/halopipe]``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "halopipe"
CORE = (
    "halopipe.system",
    "halopipe.geometry",
    "halopipe.neighbors",
    "halopipe.domain",
    "halopipe.pipeline",
    "halopipe.models",
    "halopipe.ase",
    "halopipe.testing",
)
FORBIDDEN_FOR_CORE = "halopipe.distributed"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package at ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom node, skipping ``if TYPE_CHECKING:`` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The halopipe modules ``module`` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            target = _resolve(module, path.name == "__init__.py", node)
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        for target in targets:
            found |= {t for t in _runs(target, module) if t in known and t != module}
    return found


def _runs(target: str, importer: str) -> list[str]:
    """What importing ``target`` from ``importer`` executes: the target, and each enclosing package
    ``__init__`` (below the root) that does not already hold the importer."""
    parts = target.split(".")
    parents = [".".join(parts[:k]) for k in range(2, len(parts))]
    return [target] + [p for p in parents if not _in(importer, p)]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One representative cycle per strongly connected component with more than one module (Tarjan)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(_cycle_through(sorted(component)[0], set(component), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _cycle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle start -> ... -> start inside the component (breadth first)."""
    parent: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w not in parent:
                    parent[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} lies on no cycle of its component")  # a component of >1 modules always has one


def _in(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(root: Path) -> list[str]:
    modules = module_names(root)
    known = set(modules)
    graph = {name: imports_of(name, path, known) for name, path in modules.items()}
    problems = [f"import cycle: {' -> '.join(cycle)}" for cycle in find_cycles(graph)]
    for name in sorted(graph):
        if any(_in(name, core) for core in CORE):
            for target in sorted(graph[name]):
                if _in(target, FORBIDDEN_FOR_CORE):
                    problems.append(f"layering: core module {name} imports {target}; the core must not depend on {FORBIDDEN_FOR_CORE}")
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / PACKAGE
    problems = violations(root)
    for line in problems:
        print(line)
    if not problems:
        print(f"{root}: {len(module_names(root))} modules, no import cycles, core free of {FORBIDDEN_FOR_CORE}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
