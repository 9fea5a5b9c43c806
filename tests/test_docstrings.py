"""Docstrings say what a thing does in at most three lines; the reasoning goes to docs/design/."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "lightning_tp"
MAX_LINES = 3

# Top-level areas of lightning_tp/ whose docstrings are checked: "." is the package's own modules, the others
# are folders. An area moves from PENDING to DONE once its long docstrings have gone to docs/design/.
DONE = [".", "checkpoints", "context", "dp", "experts", "explain", "faults", "kernels", "layers", "layout_search", "plans", "quant", "pipeline", "recompute", "testing", "tp_in_pp", "trainer"]
PENDING: list = []


def long_docstrings(source: str, filename: str = "<source>") -> list[str]:
    """``"file:line name (n lines)"`` for every module, class and function docstring of ``source`` over
    MAX_LINES lines (as ``ast.get_docstring`` cleans it, surrounding blank lines stripped)."""
    tree = ast.parse(source, filename)
    found = []
    for node in [tree, *ast.walk(tree)]:
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        n = len(_without_args(doc.strip().splitlines())) if doc else 0
        if n > MAX_LINES:
            found.append(f"{filename}:{getattr(node, 'lineno', 1)} {getattr(node, 'name', '<module>')} ({n} lines)")
    return sorted(set(found))


def _without_args(lines: list) -> list:
    """The lines but an ``Args:`` section of one line per argument (LightningCLI's per-option help)."""
    if "Args:" not in [line.strip() for line in lines]:
        return lines
    at = [line.strip() for line in lines].index("Args:")
    entries = lines[at + 1:]
    if all(line.startswith("    ") and not line.startswith("     ") and ": " in line for line in entries):
        head = lines[:at]
        while head and not head[-1].strip():
            head = head[:-1]
        return head
    return lines


def _files(area: str) -> list[Path]:
    return sorted(PKG.glob("*.py")) if area == "." else sorted((PKG / area).rglob("*.py"))


@pytest.mark.parametrize("area", DONE)
def test_docstrings_are_at_most_three_lines(area):
    files = _files(area)
    assert files, f"lightning_tp/{area}: no Python files (renamed? update DONE)"
    found = [hit for path in files
             for hit in long_docstrings(path.read_text(), str(path.relative_to(PKG.parent)))]
    assert not found, (f"{len(found)} docstring(s) over {MAX_LINES} lines: say what it does in at most "
                       f"{MAX_LINES} lines and move the why to docs/design/:\n" + "\n".join(found))


def test_every_area_is_done_or_pending():
    areas = {p.name for p in PKG.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    assert areas | {"."} == set(DONE) | set(PENDING), "add each top-level folder of lightning_tp/ to DONE"
    assert not set(DONE) & set(PENDING)


SYNTHETIC = '''"""One line."""


class Short:
    """Two
    lines."""

    def method(self):
        """One
        two
        three
        four."""


def long_function():
    """What it does.

    Why it does it,
    at length."""


async def long_coroutine():
    """a
    b
    c
    d"""


def three():
    """

    a
    b
    c

    """


def no_docstring():
    return """not
    a
    docstring
    either"""
'''


def test_the_check_fails_on_long_docstrings():
    assert long_docstrings(SYNTHETIC, "s.py") == [
        "s.py:15 long_function (4 lines)", "s.py:22 long_coroutine (4 lines)", "s.py:8 method (4 lines)"]
    assert long_docstrings('"""a\n\nb\n\nc"""\n', "m.py") == ["m.py:1 <module> (5 lines)"]
    assert long_docstrings('"""a\nb\nc"""\n', "m.py") == []
    # an Args section of one line per argument is LightningCLI's option help, not counted; a longer one is
    args = 'class S:\n    """What.\n\n    Args:\n        a: one.\n        b: two.\n    """\n'
    assert long_docstrings(args, "a.py") == []
    assert long_docstrings(args.replace("two.", "two,\n            and more."), "a.py") == ["a.py:1 S (6 lines)"]
