"""The package's shape: no import cycle between its modules, no private name taken from another file."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lightning_tp"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(imported module, [names]) for every import in the file, function-level ones included."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, [a.name for a in node.names]


def _graph() -> dict:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target, names in _imports(path):
            for n in names:  # "from . import zb" imports the module lightning_tp.pipeline.run.zb
                if f"{target}.{n}" in modules:
                    edges.add(f"{target}.{n}")
            if target in modules and not (names and all(f"{target}.{n}" in modules for n in names)):
                edges.add(target)
        graph[name] = edges - {name}
    return graph


def _cycle(graph: dict):
    """One import cycle as a list of modules, or None (a package's __init__ importing its own
    submodules is how a package exposes them, not a cycle, and is left out)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if m.startswith(n + "."):  # a submodule importing its own package's __init__
                continue
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_cycle_check_can_fail():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _private_imports(path: Path) -> list:
    """Private names (one leading underscore) this file imports from another module of the package."""
    return [f"{target}.{n}" for target, names in _imports(path) if target.startswith("lightning_tp")
            for n in names if n.startswith("_") and not n.startswith("__")]


def test_no_private_name_imported_across_files():
    found = {str(p.relative_to(ROOT)): _private_imports(p) for p in PKG.rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}
