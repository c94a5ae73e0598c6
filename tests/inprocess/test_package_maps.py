"""The package maps (the module lists in the packages' docstrings) name every module, and nothing that is gone."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest


@pytest.mark.parametrize("package", ["lightning_recover", "lightning_recover.strategies", "lightning_recover.recovery"])
def test_the_package_map_lists_every_module(package: str) -> None:
    pkg = importlib.import_module(package)
    modules = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    doc = pkg.__doc__ or ""
    listed = set(re.findall(r"^  ([a-z_]+)\s", doc, flags=re.M))
    assert listed == modules, f"{package}'s docstring lists {sorted(listed - modules)} that do not exist and misses {sorted(modules - listed)}"
