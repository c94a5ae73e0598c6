"""The error model (lightning_recover/errors.py) lists every exception class of the package, with its true base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import lightning_recover
from lightning_recover.errors import ERRORS, RecoverError

# The errors and exit status table lives on the failure-model page of the documentation.
ERRORS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "failure-model.md"


def _exception_classes() -> dict[str, type[BaseException]]:
    found = {}
    for info in pkgutil.walk_packages(lightning_recover.__path__, "lightning_recover."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            # Exceptions only: the fake world's RankDeath (a BaseException) simulates a process's death.
            if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == info.name and obj is not RecoverError:
                found[f"{info.name}:{name}"] = obj
    return found


def test_every_exception_of_the_package_is_in_the_error_model_and_derives_from_its_base() -> None:
    found = _exception_classes()
    assert set(found) == set(ERRORS), f"missing from ERRORS: {sorted(set(found) - set(ERRORS))}; stale: {sorted(set(ERRORS) - set(found))}"
    assert all(issubclass(cls, RecoverError) for cls in found.values()), [k for k, c in found.items() if not issubclass(c, RecoverError)]


def test_the_docs_table_names_every_exception_with_its_fate() -> None:
    text = ERRORS_PAGE.read_text()
    for key, fate in ERRORS.items():
        name = key.partition(":")[2]
        rows = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1 and f"| {fate.fate} |" in rows[0], f"docs/failure-model.md's error table: {name} ({fate.fate}): {rows}"
