"""The package's shape: no import cycle between its modules, no private name taken from another file;
the tests' shape: no test module imports another (what they share lives in helpers.py, models.py, dist.py)."""

import ast
import re
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


# ------------------------------------------------------------------ the tests' own shape

TESTS = ROOT / "tests"


def _test_modules() -> set:
    """Module names of the test files under tests/ (test_*.py, in any subfolder)."""
    return {p.stem for p in TESTS.rglob("test_*.py")}


def _imported_test_modules(source: str, test_modules: set) -> list:
    """The test modules a file's source imports: ``import``/``from`` statements anywhere in it (function
    level included, a package path such as ``pipeline.test_pipeline`` too) and importlib.import_module or
    __import__ of a literal name. Shared helpers live in modules not named test_* (helpers.py, models.py,
    dist.py)."""
    found = []

    def is_test(dotted: str) -> bool:
        return any(part in test_modules or part.startswith("test_") for part in dotted.split("."))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if is_test(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.module and is_test(node.module):
                found.append(node.module)
            else:  # from pipeline import test_pipeline
                found += [a.name for a in node.names if a.name in test_modules]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str) \
                    and is_test(node.args[0].value):
                found.append(node.args[0].value)
    return found


def test_no_test_module_imports_another():
    modules = _test_modules()
    assert {"test_parity", "test_pipeline", "test_structure"} <= modules  # the walk reaches tests/pipeline/
    found = {str(p.relative_to(ROOT)): _imported_test_modules(p.read_text(), modules) for p in TESTS.rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}, "move what they share to tests/helpers.py"


def test_test_module_import_check_can_fail():
    modules = {"test_parity", "test_core", "test_pipeline", "test_slots", "test_landed"}
    source = "\n".join([
        "import dist",
        "from helpers import check, expect_error",
        "from torch.testing import assert_close",
        "from lightning_tp.pipeline.run import zb",
        "from test_parity import BATCH, _check",
        "import test_core as core",
        "from pipeline.test_pipeline import WORLD2",
        "from pipeline import test_slots",
        "def f():",
        "    import importlib",
        "    importlib.import_module('test_landed')",
        "    return __import__('models')",
    ])
    assert _imported_test_modules(source, modules) == [
        "test_parity", "test_core", "pipeline.test_pipeline", "test_slots", "test_landed"]
    assert _imported_test_modules("import dist\nfrom models import make_model\n", modules) == []


# the public face (strategy, CLI, exports) and the spine every subsystem imports (docs/design/README.md)
FLAT = {"__init__", "__main__", "strategy", "config", "layout", "parallelize", "mesh", "comm", "marks"}


def test_flat_modules_are_the_public_face_and_the_spine():
    flat = {p.stem for p in PKG.glob("*.py")}
    assert flat == FLAT, f"new flat module(s) {sorted(flat - FLAT)}: put each in the subsystem it belongs to"
    tree = (ROOT / "docs" / "design" / "README.md").read_text()
    folders = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert all(f"  {name}/" in tree for name in folders), "docs/design/README.md's tree lacks a folder"


# what decides how gradients cross dp (zero=0, 1 or 3): made in dp/sync.py only (explain builds them to count)
GRAD_SYNC_MAKERS = re.compile(r"(?<!_grads\.)\b(DPOverlap|ZeroOverlap|shard_optimizers|shard_parameters|fully_shard)\(")


def _makers_outside(allowed: set) -> list:
    found = []
    for path in PKG.rglob("*.py"):
        rel = str(path.relative_to(PKG))
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            if GRAD_SYNC_MAKERS.search(code) and not code.lstrip().startswith(("def ", "class ")) \
                    and rel not in allowed:
                found.append(f"{rel}: {line.strip()}")
    return found


def test_one_object_owns_the_gradient_sync():
    """GradSync (dp/sync.py) makes the overlaps, the sharded optimizers and FSDP2's units; the modules that
    define them and explain's cost model (which builds them to count buckets) are the only others."""
    allowed = {"dp/sync.py", "explain/estimate.py", "dp/zero/fsdp.py", "dp/zero/optimizer.py", "dp/zero/__init__.py"}
    assert not _makers_outside(allowed)
    assert _makers_outside(allowed - {"dp/sync.py"}), "the check found nothing to refuse"


def test_the_files_conftest_orders_first_exist():
    """conftest.COSTLIEST names test files by path: a renamed one would silently lose its place."""
    import conftest

    tests = Path(__file__).resolve().parent
    missing = [name for name in conftest.COSTLIEST if not (tests / name).exists()]
    assert not missing, missing
