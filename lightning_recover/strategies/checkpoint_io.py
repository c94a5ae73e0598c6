"""Checkpoints of the leader replica: torch.distributed.checkpoint (DCP) plus one consolidated file.

Every replica holds the same state, so only the leader replica writes; its S shard ranks
save their shards through DCP on a checkpoint-only gloo group (replica-local, like torch's
default group), and a resume on any replica count *and* any shard count reads them back
resharded. A checkpoint at ``<dir>/<name>.ckpt`` -- the path Lightning's ModelCheckpoint
reports -- is two things:

* ``<dir>/.dcp/<name>.ckpt-<version>/``: the DCP directory (model and optimizer shards),
  what a resume loads;
* ``<dir>/<name>.ckpt``: one ``torch.save`` file with Lightning's keys (epoch, loops,
  callbacks, ``hyper_parameters``, ...), the resume state of lightning-recover under
  ``"lightning_recover"`` (B, G_init, T, the sample order, the policy, and which DCP
  directory belongs to it) and, with ``consolidate=True``, the full ``state_dict``, so
  ``Model.load_from_checkpoint(path)`` works in a plain Python session.

Asynchronous saving: ``save`` stages the shards into CPU memory (``dcp.async_save``) and
returns; a background thread writes them, then shard 0 publishes. Publishing renames the
DCP directory from ``*.tmp`` into place, consolidates (reads the model back from it: one
full copy of the model's state in CPU memory on that rank while the file is written),
writes the file under a temporary name and renames it over ``<name>.ckpt``, which is the
commit point; then moves the ``last.ckpt`` pointer and removes what ModelCheckpoint asked
to remove meanwhile. A kill at any point therefore leaves the previous checkpoint whole.
The next save, a removal and teardown wait for a pending one first.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_recover.callbacks.checkpoint import POINTER

STATE_KEY = "lightning_recover"
#: Hidden folder next to the checkpoint files: DCP directories and files being written.
#: Hidden and without "last" in its name, so ModelCheckpoint's look-ups never see it.
STORE = ".dcp"
MODEL_KEY = "state_dict"
OPTIMIZER_KEY = "optimizer_states"


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's (or a directory's entries') data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def point_last(directory: Path, target: Path) -> None:
    """Atomically make ``directory/last.ckpt`` a relative symlink to ``target`` (a file in ``directory``)."""
    tmp = directory / STORE / f"{POINTER}.link.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target.name, tmp)
    os.replace(tmp, directory / POINTER)
    fsync_path(directory)


def remove_checkpoint_files(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint file and every DCP directory of its name (a missing one is no error)."""
    final = Path(os.path.abspath(os.fspath(path)))
    if final.is_symlink() or final.is_file():
        final.unlink()
    for d in (final.parent / STORE).glob(f"{final.name}-*"):
        if not d.name.endswith(".tmp"):
            shutil.rmtree(d, ignore_errors=True)


def published(path: str | os.PathLike[str], step: int) -> bool:
    """Whether a save of step ``step`` to ``path`` reached its commit point: the file is there with a DCP
    directory of that step beside it (a publish removes the name's other versions)."""
    final = Path(os.path.abspath(os.fspath(path)))
    if not (final.is_file() or final.is_symlink()):
        return False
    return any(not d.name.endswith(".tmp") for d in (final.parent / STORE).glob(f"{final.name}-{step:08d}-*"))


def remove_unfinished_writes(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove what writers killed mid-way left in ``directory``'s DCP store (``*.tmp``); returns it.

    Only when no writer of this job is active there: the new leader after the old one died."""
    removed = []
    for stale in (Path(os.path.abspath(os.fspath(directory))) / STORE).glob("*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        removed.append(stale)
    return removed


#: What DCP warns on every call without a process group (one shard rank per replica writes alone, on purpose).
_SINGLE_PROCESS_DCP = r"torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) in a single process"


def quiet_single_process_dcp() -> None:
    """Leave out DCP's warning that a save or load without a process group runs in a single process: with one
    shard rank per replica that is the design, and the warning came once per rank and checkpoint."""
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_DCP)


class CheckpointWriter:
    """Saves (synchronously or in the background) and loads checkpoints of one rank; see the module docstring.

    Args:
        shard: this rank's index in its replica (0 publishes).
        shards: ranks per replica.
        async_save: write in a background thread (``save`` returns once the state is staged).
        consolidate: also write the full ``state_dict`` into the checkpoint file.
        pointer_dir: the directory whose ``last.ckpt`` follows every checkpoint published into it.
        fault_point: called with the step after the DCP write, before anything is renamed
            (fault injection; may kill this very process).
    """

    def __init__(
        self,
        shard: int,
        shards: int,
        async_save: bool = True,
        consolidate: bool = True,
        pointer_dir: str | os.PathLike[str] | None = None,
        fault_point: Callable[[int], None] = lambda step: None,
    ) -> None:
        self.shard, self.shards = shard, shards
        self.async_save, self.consolidate = async_save, consolidate
        self.pointer_dir = Path(os.path.abspath(pointer_dir)) if pointer_dir is not None else None
        self.fault_point = fault_point
        quiet_single_process_dcp()
        self._group: Any = None
        self._pending: Future[None] | None = None
        self._deferred: list[str] = []
        self._executor: ThreadPoolExecutor | None = None
        #: Seconds the last ``save`` call blocked its caller (the step loop).
        self.last_blocking_s = 0.0

    # ------------------------------------------------------------------ saving
    def save(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], step: int) -> None:
        """Write ``checkpoint`` (Lightning's dict; ``state_dict``/``optimizer_states`` hold DTensors or tensors)."""
        started = time.perf_counter()
        self.wait()
        final = Path(os.path.abspath(os.fspath(filepath)))
        version = self._agree(f"{step:08d}-{time.time_ns():x}")
        name = f"{final.name}-{version}"
        tmp = final.parent / STORE / f"{name}.tmp"
        if self.shard == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        tensors = {MODEL_KEY: checkpoint[MODEL_KEY]}
        optimizers = checkpoint.get(OPTIMIZER_KEY) or []
        if optimizers:
            tensors[OPTIMIZER_KEY] = {str(i): osd for i, osd in enumerate(optimizers)}
        # What the background thread needs, snapshotted now: the step loop changes it all.
        meta = copy.deepcopy({k: v for k, v in checkpoint.items() if k not in (MODEL_KEY, OPTIMIZER_KEY)})
        meta.setdefault(STATE_KEY, {})
        meta[STATE_KEY] = {**meta[STATE_KEY], "dcp": f"{STORE}/{name}", "optimizers": len(optimizers)}
        layout = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in tensors[MODEL_KEY].items()}
        group = self._checkpoint_group()
        if self.async_save:
            written: Future[Any] = dcp.async_save(tensors, checkpoint_id=tmp, process_group=group, no_dist=group is None)  # type: ignore[assignment]
        else:
            dcp.save(tensors, checkpoint_id=tmp, process_group=group, no_dist=group is None)
            written = Future()
            written.set_result(None)

        def finish() -> None:
            written.result()
            self.fault_point(step)
            if self.shard == 0:
                self._publish(final, tmp, name, meta, layout)

        if self.async_save:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-recover-checkpoint")
            self._pending = self._executor.submit(finish)
        else:
            finish()
        self.last_blocking_s = time.perf_counter() - started

    def _agree(self, proposal: str) -> str:
        """Shard 0's ``proposal`` on every shard rank of the writing replica."""
        group = self._checkpoint_group()
        if group is None:
            return proposal
        box = [proposal]
        dist.broadcast_object_list(box, group_src=0, group=group)
        return str(box[0])

    def _checkpoint_group(self) -> Any:
        """A gloo group over the replica's ranks for DCP alone (None with one shard rank).

        The background write runs collectives while the step loop runs its own on torch's
        default group; one group per thread keeps their order unambiguous. Created at the
        first save, which only the writing replica's ranks reach, all of them together.
        """
        if self.shards == 1 or not dist.is_initialized():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _publish(self, final: Path, tmp: Path, name: str, meta: dict[str, Any], layout: Mapping[str, Any]) -> None:
        directory, store = final.parent, final.parent / STORE
        dcp_dir = store / name
        os.replace(tmp, dcp_dir)
        fsync_path(store)
        if self.consolidate:
            meta[MODEL_KEY] = read_full_model(dcp_dir, layout)
        part = store / f"{name}.file.tmp"
        torch.save(meta, part)
        fsync_path(part)
        os.replace(part, final)  # the commit point
        fsync_path(directory)
        if self.pointer_dir is not None and directory == self.pointer_dir and final.name != POINTER:
            point_last(directory, final)
        # Older versions of this name, and leftovers of writers killed mid-way (one writer at a time).
        for old in store.glob(f"{final.name}-*"):
            if old.name != name and not old.name.endswith(".tmp"):
                shutil.rmtree(old, ignore_errors=True)
        for stale in store.glob("*.tmp"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        removals, self._deferred = self._deferred, []
        for path in removals:
            if Path(os.path.abspath(path)) != final:
                remove_checkpoint_files(path)

    def wait(self) -> None:
        """Block until the pending background save (if any) is published; re-raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @property
    def pending(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def remove(self, filepath: str | os.PathLike[str]) -> None:
        """Remove a checkpoint; while a save is pending, after it is published (the pointer may still name this one)."""
        if self._pending is not None and not self._pending.done():
            self._deferred.append(os.fspath(filepath))
            return
        self.wait()
        remove_checkpoint_files(filepath)

    def close(self) -> None:
        """Wait for the pending save and stop the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def read_full_model(dcp_dir: str | os.PathLike[str], layout: Mapping[str, Any]) -> dict[str, Any]:
    """The model's full (unsharded) state dict from a DCP directory, read in this process alone."""
    full = {k: torch.empty(v[0], dtype=v[1]) if isinstance(v, tuple) else v for k, v in layout.items()}
    dcp.load({MODEL_KEY: full}, checkpoint_id=os.fspath(dcp_dir), no_dist=True)
    return full


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Path]:
    """A checkpoint file's keys without its consolidated weights, and its DCP directory."""
    real = Path(os.path.realpath(os.fspath(path)))
    if real.is_dir():
        raise IsADirectoryError(f"{os.fspath(path)!r} is a directory; pass a checkpoint file (<name>.ckpt) that ModelCheckpoint reported")
    if not real.is_file():
        raise FileNotFoundError(f"checkpoint {os.fspath(path)!r} not found")
    # mmap: the consolidated weights are not read; the DCP directory holds what a resume loads.
    checkpoint = torch.load(real, map_location="cpu", weights_only=False, mmap=True)
    checkpoint.pop(MODEL_KEY, None)
    state = checkpoint.get(STATE_KEY)
    if not isinstance(state, dict) or "dcp" not in state:
        raise ValueError(f"{os.fspath(path)!r} was not written by ReCoVerHSDPStrategy (no '{STATE_KEY}' state naming its DCP directory)")
    dcp_dir = real.parent / state["dcp"]
    if not dcp_dir.is_dir():
        raise FileNotFoundError(
            f"{os.fspath(path)!r} names its shards in {str(dcp_dir)!r}, which is missing; keep the {STORE}/ folder next to "
            "the checkpoint files (copy both when moving checkpoints)"
        )
    return checkpoint, dcp_dir


def load_into(
    dcp_dir: Path, model_state: dict[str, Any], optimizer_states: Sequence[dict[str, Any]], group: Any = None
) -> None:
    """Fill ``model_state`` (and ``optimizer_states``) in place from ``dcp_dir``, resharded to their layout."""
    target: dict[str, Any] = {MODEL_KEY: model_state}
    if optimizer_states:
        target[OPTIMIZER_KEY] = {str(i): osd for i, osd in enumerate(optimizer_states)}
    dcp.load(target, checkpoint_id=os.fspath(dcp_dir), process_group=group, no_dist=not dist.is_initialized())


# The strategy's checkpoint hooks: the model's and optimizers' state as FSDP2-aware state dicts
# (DTensor shards where the model is sharded), so DCP saves and loads shards, never full copies.
def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state dict (DTensor shards: references; a save stages the copy)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def load_model_state(model: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
    """Load ``state_dict`` (full or sharded) into ``model``'s shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, dict(state_dict), options=StateDictOptions(strict=strict))


def optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """``optimizer``'s state dict over ``model``'s shards."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


def load_optimizer_states(model: torch.nn.Module, optimizers: Sequence[Any], states: Sequence[dict[str, Any]]) -> None:
    """Load each optimizer's state dict (in order) over ``model``'s shards."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for opt, state in zip(optimizers, states):
        set_optimizer_state_dict(model, opt, state)


def load(
    path: str | os.PathLike[str], model: torch.nn.Module, optimizers: Sequence[Any], *, fitting: bool,
    guard: Callable[[], AbstractContextManager[None]],
) -> dict[str, Any]:
    """A checkpoint as Lightning loads it: its keys from the file, the model's (and, when ``fitting`` with
    ``optimizers``, their) state from its DCP directory, resharded to ``model``'s layout; ``guard`` wraps the read."""
    checkpoint, dcp_dir = read_checkpoint(path)
    fitting = fitting and bool(optimizers)
    if fitting and checkpoint[STATE_KEY].get("optimizers", 0) < len(optimizers):
        fitting = False  # a weights-only checkpoint: Lightning itself refuses to resume training from it
    state = model_state(model)
    optimizer_states = [optimizer_state(model, opt) for opt in optimizers] if fitting else []
    with guard():
        load_into(dcp_dir, state, optimizer_states)
    checkpoint["state_dict"] = state
    if fitting:
        checkpoint["optimizer_states"] = optimizer_states
    return checkpoint
