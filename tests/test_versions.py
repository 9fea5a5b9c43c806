"""What README and pyproject.toml say is supported holds for what this suite runs on: the installed torch,
lightning and transformers are inside pyproject's ranges, transformers' range is bounded above, and README
names the ranges."""

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _requirements() -> dict:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {Requirement(r).name: Requirement(r) for r in listed}


def test_the_installed_versions_are_inside_the_stated_ranges():
    reqs = _requirements()
    for name in ("torch", "lightning", "transformers"):
        installed = version(name).split("+")[0]
        assert reqs[name].specifier.contains(installed, prereleases=True), (name, installed, str(reqs[name]))
    assert any(s.operator == "<" for s in reqs["transformers"].specifier), "an unbounded range promises 6.x"


def test_readme_states_the_supported_ranges():
    readme = (ROOT / "README.md").read_text()
    reqs = _requirements()
    for name in ("torch", "lightning"):
        floor = next(s.version for s in reqs[name].specifier if s.operator == ">=")
        assert re.search(rf"{name} >= {re.escape(floor)}", readme), (name, floor)
    assert "transformers 4.57 to 5.x" in readme and "Tested:" in readme
