"""The package maps (the module lists in the packages' docstrings) name every module, and nothing that is gone."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "lightning_recover"
#: The package and every folder of it: each one's docstring maps its modules.
PACKAGES = ["lightning_recover"] + sorted(
    "lightning_recover." + p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in ROOT.glob("*/**/__init__.py")
)


def test_every_folder_is_a_package() -> None:
    """A folder of modules without ``__init__.py`` would escape setuptools' package list and these maps."""
    folders = [d for d in ROOT.rglob("*") if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))]
    missing = sorted(d.relative_to(ROOT).as_posix() for d in folders if not (d / "__init__.py").exists())
    assert not missing, f"folders {missing} hold modules but no __init__.py; add one whose docstring maps them"


@pytest.mark.parametrize("package", PACKAGES)
def test_the_package_map_lists_every_module(package: str) -> None:
    pkg = importlib.import_module(package)
    modules = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    doc = pkg.__doc__ or ""
    listed = set(re.findall(r"^  ([a-z_]+)\s", doc, flags=re.M))
    assert listed == modules, f"{package}'s docstring lists {sorted(listed - modules)} that do not exist and misses {sorted(modules - listed)}"
