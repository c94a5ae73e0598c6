"""The package's layers: every import points down, no module cycle, Lightning and MPI where they belong;
few long functions; nothing in the package needs root; no test or benchmark edits ``sys.path``.

The package is cut into layers (its folders, see the map in ``lightning_recover/__init__.py``);
a module may import its own layer and the layers below it, never one above. This test reads
every module's source (``ast``, nothing is imported) and builds the import graph from all of
its imports: absolute and relative, at module level, under ``if TYPE_CHECKING:`` and inside
functions (a lazy import is still a dependency, and an upward one is how cycles come back).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "lightning_recover"
CHECKOUT = Path(__file__).resolve().parents[2]
ROOT = CHECKOUT / PACKAGE

#: The layers, bottom up. A module's layer is its folder; the root's modules are named one by one.
LAYERS: list[str] = [
    "base",  # errors, _compat, _lightning, config: what every layer may use
    "workload",  # ReCoVer's versatile workload, pure: policy and planner
    "audit",  # ledger, report, corruption fingerprints, write fences
    "runtime",  # a rank's process: lifecycle, markers, Slurm, watchdog
    "comm",  # ReCoVer's fault-aware collectives: communicator, data planes, process group, the engine's contract
    "membership",  # hot re-join: recruiter, standbys, state transfer, the replacement's entry
    "recovery",  # ReCoVer's in-step recovery: the step engine, the running job, the admission of replacements
    "feed",  # exactly-once data
    "callbacks",  # Lightning callbacks (and loggers)
    "strategies",  # the Lightning strategy
    "testing",  # the simulated world (FakeWorld); the rigs that need root live in benchmarks/rigs
    "cli",  # the launch side
    "api",  # lightning_recover/__init__.py: the public names, resolved lazily from any layer
]
BASE_MODULES = {"errors", "_compat", "_lightning", "config"}
#: Only these may import Lightning: the strategy and callback layers, and the one home of its private API.
LIGHTNING_LAYERS = {"callbacks", "strategies"}
LIGHTNING_MODULES = {f"{PACKAGE}._lightning"}
LIGHTNING_ROOTS = {"lightning", "pytorch_lightning"}
#: Pure layers: decided on every rank from the same inputs and tested without a world.
PURE_LAYERS = {"workload", "audit"}

#: Known upward imports, each with the reason it is still there. The test fails when one of
#: them is gone too, so that this list only ever shrinks.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is written."""

    source: str  # the importing module
    target: str  # the imported module (or package), absolute
    path: Path
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    if (ROOT / parts[1]).is_dir():
        return parts[1]
    if parts[1] in BASE_MODULES:
        return "base"
    raise AssertionError(
        f"{module} is a module at the package root outside the base layer ({sorted(BASE_MODULES)}); "
        f"move it into the folder of its layer, or add it to BASE_MODULES in {Path(__file__).name} if every layer needs it"
    )


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import in ``path``: absolute and relative, at any depth of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, path, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
                full = f"{base}.{alias.name}"
                found.append(Import(module, full if full in MODULES else base, path, node.lineno))
    return found


IMPORTS: list[Import] = [imp for module, path in MODULES.items() for imp in imports_of(module, path)]
INTERNAL: list[Import] = [imp for imp in IMPORTS if imp.target == PACKAGE or imp.target.startswith(PACKAGE + ".")]


def where(imp: Import) -> str:
    return f"{imp.path.relative_to(ROOT.parent)}:{imp.line}"


def test_every_module_has_a_known_layer() -> None:
    for module in MODULES:
        assert layer_of(module) in LAYERS, f"{module} is in folder {layer_of(module)!r}, which is not in LAYERS; add the folder to LAYERS in its place"
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(LAYERS), f"packages {sorted(folders - set(LAYERS))} are not layers; add them to LAYERS in their place, bottom up"


def test_imports_point_down_the_layers() -> None:
    upward: list[str] = []
    used: set[tuple[str, str]] = set()
    for imp in INTERNAL:
        if imp.target not in MODULES:
            upward.append(f"{where(imp)}: {imp.source} imports {imp.target}, which is no module of the package; fix the path")
            continue
        low, high = layer_of(imp.source), layer_of(imp.target)
        if LAYERS.index(high) <= LAYERS.index(low):
            continue
        key = (imp.source, imp.target)
        if key in ALLOWED_UPWARD:
            used.add(key)
            continue
        upward.append(
            f"{where(imp)}: {imp.source} (layer {low}) imports {imp.target} (layer {high}, above it); "
            f"pass what it needs in from above (a parameter or callable, a Protocol for a type) or move the shared piece down to {low} or below"
        )
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)
    stale = set(ALLOWED_UPWARD) - used
    assert not stale, f"ALLOWED_UPWARD names imports that are gone: {sorted(stale)}; delete them from the list"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a path whose last node is its first, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_cycle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], str] = {}
    for imp in INTERNAL:
        # A known upward import (ALLOWED_UPWARD) is the one edge of its cycle that is already on record.
        if imp.target in MODULES and imp.target != imp.source and (imp.source, imp.target) not in ALLOWED_UPWARD:
            graph.setdefault(imp.source, set()).add(imp.target)
            lines.setdefault((imp.source, imp.target), where(imp))
    cycle = find_cycle(graph)
    assert cycle is None, (
        "import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(f"  {lines[a, b]}: {a} imports {b}" for a, b in zip(cycle, cycle[1:]))
        + "\nbreak it: the lower module takes what it needs as a parameter (or names its type with a Protocol), or the shared piece moves down"
    )


def test_only_the_lightning_layers_import_lightning() -> None:
    wrong = [
        f"{where(imp)}: {imp.source} imports {imp.target}; only {sorted(LIGHTNING_LAYERS)} (and {PACKAGE}._lightning for private API) "
        "may import Lightning: move the Lightning-facing part there and pass plain values down"
        for imp in IMPORTS
        if imp.target.split(".")[0] in LIGHTNING_ROOTS
        and layer_of(imp.source) not in LIGHTNING_LAYERS
        and imp.source not in LIGHTNING_MODULES
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("layer", sorted(PURE_LAYERS))
def test_pure_layers_import_neither_torch_distributed_nor_mpi(layer: str) -> None:
    modules = [m for m in MODULES if layer_of(m) == layer]
    assert modules, f"layer {layer} has no modules; remove it from PURE_LAYERS"
    wrong = [
        f"{where(imp)}: {imp.source} imports {imp.target}; the {layer} layer is pure (no torch.distributed, no MPI): "
        "take the result of the communication as a parameter instead"
        for imp in IMPORTS
        if imp.source in modules
        and (imp.target == "mpi4py" or imp.target.startswith("mpi4py.") or imp.target == "torch.distributed" or imp.target.startswith("torch.distributed."))
    ]
    assert not wrong, "\n".join(wrong)


def scanned_module(tmp_path: Path, relative: str, source: str) -> Path:
    """A module of a throwaway package under ``tmp_path`` (``relative`` to the package), for a scanner's own test."""
    path = tmp_path / PACKAGE / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return path


def test_the_graph_sees_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    """The scanner itself: an upward import hidden in a function, a relative import and a TYPE_CHECKING one all count."""
    source = scanned_module(
        tmp_path, "comm/x.py",
        "from typing import TYPE_CHECKING\n"
        "from . import topology\n"
        "if TYPE_CHECKING:\n"
        "    from ..recovery.engine import Probes\n"
        "def f():\n"
        "    from lightning_recover.strategies import recover_hsdp\n"
    )
    targets = {imp.target for imp in imports_of(f"{PACKAGE}.comm.x", source)}
    assert {f"{PACKAGE}.comm.topology", f"{PACKAGE}.recovery.engine", f"{PACKAGE}.strategies.recover_hsdp"} <= targets
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


#: Issue 38: at most this many functions of the package are longer than LONG_FUNCTION lines (a step,
#: a command, a repair must read top to bottom; split by what each part decides).
LONG_FUNCTION = 60
LONG_FUNCTIONS_ALLOWED = 3


def long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > LONG_FUNCTION:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_few_package_functions_are_long() -> None:
    found = long_functions(ROOT)
    assert len(found) <= LONG_FUNCTIONS_ALLOWED, (
        f"{len(found)} functions over {LONG_FUNCTION} lines (at most {LONG_FUNCTIONS_ALLOWED}): {found}; split the new one")


def test_the_long_function_count_sees_a_long_function(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def short():\n    return 1\n\n\ndef long():\n" + "    x = 1\n" * LONG_FUNCTION + "    return x\n")
    assert long_functions(pkg) == [f"pkg/m.py:5 long ({LONG_FUNCTION + 2} lines)"]


#: What only root may do: network namespaces and their tools, packet filters, mounts. The rigs that
#: do it (fake hosts) live in benchmarks/rigs, outside the wheel.
ROOT_ONLY_TOOLS = {"ip", "nsenter", "unshare", "iptables", "tc", "mount", "umount", "setns"}
ROOT_ONLY_WORDS = ("netns", "CLONE_NEW")


def root_needs(root: Path) -> list[str]:
    """Where a module under ``root`` runs a root-only tool (an argv's first string) or names a namespace."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
                first = node.elts[0]
                if isinstance(first, ast.Constant) and first.value in ROOT_ONLY_TOOLS:
                    found.append(f"{where} runs {first.value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in {"unshare", "setns"}:
                found.append(f"{where} calls {node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{where} names {w!r}" for w in ROOT_ONLY_WORDS if w in node.value]
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1].split()[0])))


def test_nothing_in_the_package_needs_root() -> None:
    assert root_needs(ROOT) == [], "move what needs root to benchmarks/rigs (the test and benchmark side)"


def test_the_root_check_sees_a_namespace_rig(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("import os, subprocess\nsubprocess.run(['ip', 'link'])\nos.unshare(0)\nNS = '/var/run/netns'\n")
    assert root_needs(pkg) == ["pkg/m.py:2 runs 'ip'", "pkg/m.py:3 calls unshare", "pkg/m.py:4 names 'netns'"]


def sys_path_edits(root: Path) -> list[str]:
    """Where a module under ``root`` changes ``sys.path``, in its code or in code it writes for a child."""
    found = []
    for path in sorted(p for p in root.rglob("*.py") if p != Path(__file__).resolve()):  # not the checks' own examples
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "path"
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "sys"
                    and node.attr in {"insert", "append", "extend", "remove"}):
                found.append(f"{where} sys.path.{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "sys.path." in node.value:
                found.append(f"{where} writes code that edits sys.path")
    return sorted(found)


@pytest.mark.parametrize("folder", ["benchmarks", "tests"])
def test_no_benchmark_or_test_edits_sys_path(folder: str) -> None:
    # benchmarks is a package (python -m benchmarks.NAME from the root); pytest's pythonpath
    # (pyproject.toml) and the launched jobs' PYTHONPATH reach the rest.
    assert sys_path_edits(CHECKOUT / folder) == []


def test_the_sys_path_check_sees_an_edit(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("import sys\nsys.path.insert(0, 'x')\nCODE = \"import sys; sys.path.append('y')\"\n")
    assert sys_path_edits(pkg) == ["pkg/m.py:2 sys.path.insert", "pkg/m.py:3 writes code that edits sys.path"]


# Issue 38: recovery hooks are typed method calls on RecoveryHooks (recovery/hooks.py's HookCalls), never
# looked up by name, and a hook that communicates gets its collectives as an argument: no callback reaches
# into the strategy for the communicator or the step engine.
HOOKS_MODULE = ROOT / "recovery" / "hooks.py"
#: Attributes of the strategy a callback must not read: what it needs comes in through the hooks' arguments.
STRATEGY_INTERNALS = {"engine", "comm"}
REFLECTION = {"getattr", "hasattr", "setattr", "delattr"}


def hook_names(path: Path = HOOKS_MODULE) -> set[str]:
    """The recovery hooks' method names: the methods of class RecoveryHooks in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "RecoveryHooks"]
    assert len(classes) == 1, f"{path} defines class RecoveryHooks once (found {len(classes)})"
    return {node.name for node in classes[0].body if isinstance(node, ast.FunctionDef) and node.name.startswith("on_")}


def _is_strategy(node: ast.expr) -> bool:
    """``strategy`` or ``<anything>.strategy``: the object a callback reaches the strategy through."""
    return (isinstance(node, ast.Name) and node.id == "strategy") or (isinstance(node, ast.Attribute) and node.attr == "strategy")


def _shown(path: Path) -> str:
    """``path`` as the messages show it: relative to the repository where it lies in it."""
    return str(path.relative_to(ROOT.parent)) if path.is_relative_to(ROOT.parent) else str(path)


def _literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def strategy_internals_read(path: Path) -> list[str]:
    """Where ``path`` reads ``strategy.engine`` / ``strategy.comm`` (also ``x.strategy.comm``, ``getattr(strategy, "comm")``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr in STRATEGY_INTERNALS and _is_strategy(node.value):
            found.append(f"{_shown(path)}:{node.lineno} {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REFLECTION and len(node.args) >= 2
            and _is_strategy(node.args[0]) and _literal(node.args[1]) in STRATEGY_INTERNALS
        ):
            found.append(f"{_shown(path)}:{node.lineno} {ast.unparse(node)}")
    return found


def hooks_by_name(path: Path, hooks: set[str], *, dispatching: bool) -> list[str]:
    """Where ``path`` names a recovery hook as a string: a string constant equal to a hook's name (a name
    table, ``dispatch("on_...")``), or getattr/hasattr/setattr/delattr with an ``on_...`` literal; in a
    module that calls hooks (``dispatching``), also any such call whose name is not a literal at all."""
    found = []
    where = _shown(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in hooks:
            found.append(f"{where}:{node.lineno} the string {node.value!r}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REFLECTION and len(node.args) >= 2:
            name = _literal(node.args[1])
            if (name is not None and name.startswith("on_")) or (name is None and dispatching):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def dispatching_modules() -> list[Path]:
    """recovery/hooks.py and every module that imports it: where hooks are called."""
    hooks_module = module_name(HOOKS_MODULE)
    return sorted({HOOKS_MODULE} | {imp.path for imp in INTERNAL if imp.target == hooks_module})


def test_callbacks_read_neither_the_strategys_engine_nor_its_comm() -> None:
    found = [hit for path in sorted((ROOT / "callbacks").rglob("*.py")) for hit in strategy_internals_read(path)]
    assert not found, (
        "callbacks reach into the strategy for collectives:\n" + "\n".join(found)
        + "\na recovery hook that communicates uses its `collectives` argument (recovery.hooks.StepCollectives)"
    )


def test_no_recovery_hook_is_found_by_name() -> None:
    hooks = hook_names()
    assert {"on_before_reduce", "on_step_committed", "on_world_repaired"} <= hooks, f"RecoveryHooks' methods not found: {sorted(hooks)}"
    dispatching = set(dispatching_modules())
    assert len(dispatching) > 2, f"no module imports {HOOKS_MODULE.name}? {sorted(dispatching)}"
    found = [hit for path in sorted(ROOT.rglob("*.py")) for hit in hooks_by_name(path, hooks, dispatching=path in dispatching)]
    assert not found, (
        "recovery hooks named as strings:\n" + "\n".join(found)
        + "\ncall them as typed methods (recovery.hooks.HookCalls: cb.on_before_reduce(...) on RecoveryHooks instances)"
    )


def test_the_hook_scanners_see_what_they_forbid(tmp_path: Path) -> None:
    """The scanners themselves, on the patterns of the code issue 38 replaced."""
    callback = scanned_module(
        tmp_path, "callbacks/cb.py",
        "def f(trainer, strategy):\n"
        "    comm, engine = strategy.comm, strategy.engine\n"
        "    trainer.strategy.engine.run_collective(comm.barrier)\n"
        "    return getattr(trainer.strategy, 'comm', None), trainer.strategy.model\n"
    )
    found = strategy_internals_read(callback)
    assert sorted(hit.split(" ", 1)[1] for hit in found) == sorted([
        "strategy.comm", "strategy.engine", "trainer.strategy.engine", "getattr(trainer.strategy, 'comm', None)",
    ]), found
    dispatch = scanned_module(
        tmp_path, "callbacks/d.py",
        "HOOKS = ('on_before_reduce',)\n"
        "def dispatch(cbs, name, *args):\n"
        "    for cb in cbs:\n"
        "        fn = getattr(cb, name, None)\n"
        "        if hasattr(cb, 'on_other'):\n"
        "            pass\n"
        "    getattr(cbs, 'size')\n"
    )
    assert len(hooks_by_name(dispatch, {"on_before_reduce"}, dispatching=True)) == 3
    assert len(hooks_by_name(dispatch, {"on_before_reduce"}, dispatching=False)) == 2, "a non-literal getattr counts only where hooks are called"
    assert hook_names() >= {"on_before_overlap", "on_replicas_joined"}


#: The protocol's state lives in these layers; a state object holds at most this many fields
#: (StepState keeps the engine's decisions and one small part per owner).
STATE_LAYERS = ("workload", "comm", "membership", "recovery")
STATE_FIELDS = 12


def wide_dataclasses(root: Path, layers: tuple[str, ...], limit: int) -> list[str]:
    """The dataclasses of ``layers`` under ``root`` with more than ``limit`` fields."""
    found = []
    for layer in layers:
        for path in sorted((root / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ClassDef) or not any(
                    "dataclass" in ast.unparse(d) for d in node.decorator_list
                ):
                    continue
                fields = [b for b in node.body if isinstance(b, ast.AnnAssign) and "ClassVar" not in ast.unparse(b.annotation)]
                if len(fields) > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({len(fields)} fields)")
    return found


def test_no_protocol_state_object_holds_more_than_twelve_fields() -> None:
    assert wide_dataclasses(ROOT, STATE_LAYERS, STATE_FIELDS) == [], "split it by owner, as recovery/state.py does"


def test_the_field_count_sees_a_wide_dataclass(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "recovery").mkdir(parents=True)
    body = "".join(f"    f{i}: int = 0\n" for i in range(STATE_FIELDS + 1))
    (tmp_path / "pkg" / "recovery" / "s.py").write_text(
        f"from dataclasses import dataclass\n\n@dataclass\nclass Wide:\n{body}\n@dataclass(frozen=True)\nclass Narrow:\n    a: int\n"
    )
    assert wide_dataclasses(tmp_path / "pkg", ("recovery",), STATE_FIELDS) == [f"pkg/recovery/s.py:4 Wide ({STATE_FIELDS + 1} fields)"]
