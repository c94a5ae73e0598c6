"""Fault-tolerant GPT pre-training with lightning-recover, configured by Hydra.

Run it under the launcher (ULFM must be switched on when the job starts)::

    lightning-recover launch -n 4 -- python examples/pretrain.py model=tiny trainer.max_steps=6 \\
        'fault.schedule=[{step:3,rank:2,phase:backward,kind:kill}]' hydra.run.dir=runs/demo

A single process (``python examples/pretrain.py ...``) runs too: an MPI singleton, world size 1.
Configuration lives in ``examples/conf/`` (groups ``model``, ``data``, ``recover``, ``fault``,
``trainer``). Everything a run writes goes to the run directory (``hydra.run.dir``), shared
by all ranks: ``ledger.jsonl`` (one line per committed step), ``logs/version_N/metrics.csv``
(and TensorBoard events when ``tensorboard`` is installed), ``.hydra/`` and ``pretrain.log``.

The ``recover`` group is typed by :class:`lightning_recover.config.RecoverConfig` (its
structured schema) and built once into that frozen object, which the strategy receives.
Bad settings stop the job before the first step with exit code 2 and one line on stderr
(``pretrain.py: error: ...``) naming the value and the fix; every refusal is a
:class:`~lightning_recover.config.ConfigurationError`. Set ``LR_TRACEBACK=1`` to get the full
traceback instead.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

# Light imports only: configuration mistakes are reported before torch and Lightning load
# (seconds per rank). Heavy modules are imported in train().
from lightning_recover.config import ConfigurationError, RecoverConfig, fold_short_forms

EXAMPLES = Path(__file__).resolve().parent
sys.path.insert(0, str(EXAMPLES))

# The fields of examples/model.py's GPTConfig (checked against it by tests/launched/test_pretrain.py).
MODEL_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "lr", "weight_decay", "warmup_steps")

PROG = "pretrain.py"
# Lightning precision values that mean fp16 autocast with a GradScaler.
FP16_WITH_SCALER = ("16-mixed", "16", "16-mixed-precision")


# ---------------------------------------------------------------------- launch environment
def env_rank() -> int:
    """This process's world rank as the launcher set it (0 for a single process)."""
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0")))


def env_world_size() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))


_STAMP: str | None = None


def run_stamp() -> str:
    """``YYYY-MM-DD/HH-MM-SS`` of rank 0's start, the same on every rank (hydra.run.dir default).

    Ranks import torch at different speeds, so their own clocks would name different
    directories; rank 0's stamp is broadcast once. ``LR_RUN_STAMP`` overrides it.
    """
    global _STAMP
    if _STAMP is None:
        stamp = os.environ.get("LR_RUN_STAMP") or time.strftime("%Y-%m-%d/%H-%M-%S")
        if "LR_RUN_STAMP" not in os.environ and env_world_size() > 1:
            import mpi4py

            mpi4py.rc.finalize = False  # as lightning_recover.comm.communicator: never block in MPI_Finalize
            from mpi4py import MPI

            stamp = MPI.COMM_WORLD.bcast(stamp, root=0)
            # Exported in a launched job: a replacement spawned by hot re-join takes the survivors'
            # LR_* variables (lightning_recover.membership.seat.job_environ), so it writes into this same run
            # directory (its own spawn's rank 0 would stamp another one).
            os.environ["LR_RUN_STAMP"] = stamp
        _STAMP = stamp
    return _STAMP


def on_leader(value: Any) -> Any:
    """``value`` on rank 0, None elsewhere (only the leader writes Hydra's .hydra/ files)."""
    return value if env_rank() == 0 else None


OmegaConf.register_new_resolver("run_stamp", run_stamp, replace=True)
OmegaConf.register_new_resolver("on_leader", on_leader, replace=True)


# ---------------------------------------------------------------------- validation
def _int(name: str, value: Any, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name}={value!r} is not an integer; {fix}")
    if value < minimum:
        raise ConfigurationError(f"{name}={value!r} must be >= {minimum}; {fix}")
    return value


def _positive(name: str, value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"{name}={value!r} must be a positive number ({what})")
    return float(value)


def check_writable_dir(name: str, path: str) -> None:
    """Create ``path`` if needed and write (then remove) a probe file in it."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigurationError(f"{name}={path!r} is not a writable directory ({exc.strerror or exc}); set {name} to one") from None


def check_ledger_path(path: str | None) -> None:
    """Refuse a ledger path the leader could not write, by a test-write (removed again)."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigurationError(
            f"recover.ledger_path={path!r} is a directory; give a file path such as {os.path.join(path, 'ledger.jsonl')!r}"
        )
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        existed = p.exists()
        with open(p, "a", encoding="utf-8"):
            pass
        if not existed:
            p.unlink(missing_ok=True)
    except OSError as exc:
        blocker = next((a for a in p.parents if a.exists()), None)
        why = f"{str(blocker)!r} is not a directory" if blocker is not None and not blocker.is_dir() else (exc.strerror or str(exc))
        raise ConfigurationError(
            f"recover.ledger_path={path!r} is not writable ({why}); "
            "set recover.ledger_path to a file in a writable directory (or null for no ledger)"
        ) from None


def validate(cfg: DictConfig, world_size: int | None = None) -> RecoverConfig:
    """The configuration checks that need neither torch nor MPI (the fault schedule is parsed later).

    Returns the strategy's settings (:func:`recover_config`), checked against the job's size;
    when resuming (``ckpt_path`` set) without ``target_replicas``, which the checkpoint
    supplies. ``world_size`` defaults to the launcher's (1 for a single process). What only
    the live job can tell (ULFM on, dataset size vs. B, Trainer and precision settings) is
    checked by ReCoVerHSDPStrategy during ``trainer.fit`` setup, still before the first step.
    """
    world = env_world_size() if world_size is None else world_size
    _int("seed", cfg.seed, 0, "set seed to a non-negative integer")

    unknown = sorted(set(cfg.model) - set(MODEL_FIELDS) - {"name"})
    if unknown:
        raise ConfigurationError(f"model.{unknown[0]} is not a model setting; known: {', '.join(MODEL_FIELDS)}")
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        _int(f"model.{key}", cfg.model[key], 1, f"set model.{key} to a positive integer")
    if cfg.model.n_embd % cfg.model.n_head:
        raise ConfigurationError(f"model.n_embd={cfg.model.n_embd} is not divisible by model.n_head={cfg.model.n_head}; change one of them")
    dropout = cfg.model.dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigurationError(f"model.dropout={dropout!r} must be a number in [0, 1)")
    _positive("model.lr", cfg.model.lr, "the peak learning rate")

    corpus = cfg.data.corpus
    if corpus is not None and not Path(str(corpus)).exists():
        raise ConfigurationError(
            f"data.corpus={str(corpus)!r} does not exist; set data.corpus to a text file or a directory of text "
            "files, or data.corpus=null for the Python standard library"
        )
    _int("data.max_bytes", cfg.data.max_bytes, 2, "set data.max_bytes to the number of corpus bytes to read")
    _int("data.microbatch_size", cfg.data.microbatch_size, 1, "set data.microbatch_size to a positive integer")

    recover = recover_config(cfg)
    if cfg.get("ckpt_path") is not None:
        # Resuming: T (like B and G_init) comes from the checkpoint, which may have had more replicas.
        recover = dataclasses.replace(recover, target_replicas=None)
    recover.check_world(world)
    check_ledger_path(recover.ledger_path)
    if recover.checkpoint.enabled:
        check_writable_dir("recover.checkpoint.dir", str(recover.checkpoint.dir))
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is not None and str(ckpt_path) != "last" and not Path(str(ckpt_path)).is_file():
        raise ConfigurationError(f"ckpt_path={str(ckpt_path)!r} is not a checkpoint file; use ckpt_path=last or a step-N.ckpt file")

    max_steps = cfg.trainer.get("max_steps", -1)
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or not (max_steps == -1 or max_steps >= 1):
        raise ConfigurationError(f"trainer.max_steps={max_steps!r} must be a positive integer (or -1 to train by epochs)")
    precision = cfg.trainer.get("precision", "32-true")
    if str(precision) in FP16_WITH_SCALER:
        raise ConfigurationError(
            f"trainer.precision={precision!r} trains fp16 with a GradScaler, whose skipped steps would desynchronise "
            "the replicas; use trainer.precision=bf16-mixed or trainer.precision=32-true"
        )
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    if accumulate != 1:
        raise ConfigurationError(
            f"trainer.accumulate_grad_batches={accumulate!r}: the strategy accumulates itself; "
            "leave trainer.accumulate_grad_batches=1 and set recover.grad_accum instead"
        )
    raw = cfg.fault.get("schedule", None)
    if raw is not None and not isinstance(raw, ListConfig):
        raise ConfigurationError(
            f"fault.schedule={raw!r} is not a list; write it as "
            "'fault.schedule=[{step:3,rank:2,phase:backward,kind:kill}]' (or [] for no faults)"
        )
    return recover


def recover_schema() -> DictConfig:
    """RecoverConfig as an OmegaConf structured config: the typed schema of the ``recover`` group.

    OmegaConf makes a frozen dataclass's nodes read-only, which would refuse the merge of
    the group's values, so every node is made writable (the frozen object comes out of
    :func:`recover_config`). It is merged here rather than registered in Hydra's ConfigStore:
    Hydra reports a type error met while composing itself (exit 1, several lines), and
    this script's contract is exit 2 with one line naming the value and the fix.
    """
    schema = OmegaConf.structured(RecoverConfig)
    nodes = [schema]
    while nodes:
        node = nodes.pop()
        OmegaConf.set_readonly(node, False)
        nodes.extend(v for v in node.values() if isinstance(v, DictConfig))
    return schema


def recover_config(cfg: DictConfig) -> RecoverConfig:
    """The ``recover`` group (and the top-level ``seed``) as one validated RecoverConfig.

    The values are resolved, their short forms put into their section (``recover.rejoin=true``
    is ``recover.rejoin.enabled=true``; ``+recover.rejoin_standbys=2``, or ``rejoin_standbys: 2``
    in a group file written before the section, is ``recover.rejoin.standbys=2``), merged into
    :func:`recover_schema` (typing them: a quoted number becomes a number, an unknown key is
    refused) and turned into the frozen dataclass, whose ``__post_init__`` checks every field.
    """
    try:
        raw = OmegaConf.to_container(cfg.recover, resolve=True)
    except InterpolationResolutionError as exc:
        key = exc.full_key or "recover"
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigurationError(
            f"{key} cannot be resolved ({cause}); run pretrain.py itself (a Hydra run) or set {key} explicitly"
        ) from None
    assert isinstance(raw, dict)
    if "seed" in raw:
        raise ConfigurationError(f"recover.seed={raw['seed']!r} is not a setting here: the top-level seed seeds everything; use seed=N")
    raw["seed"] = cfg.seed
    for section in ("checkpoint", "rejoin"):
        if raw.get(section, {}) is None:
            del raw[section]  # recover.checkpoint=null, recover.rejoin=null: the section's defaults (off)
    # The schema types recover.rejoin as the section, so its short forms are folded in first. The YAML
    # spells the whole section, so a flat key the user added overrides the section's value.
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    refuse_replaced_section(raw, overrides)
    raw = fold_short_forms(raw, flat_over_section=True)
    try:
        config = OmegaConf.to_object(OmegaConf.merge(recover_schema(), raw))
    except OmegaConfBaseException as exc:
        raise _schema_error(exc, raw) from None
    assert isinstance(config, RecoverConfig)
    return config


def refuse_replaced_section(raw: dict[str, Any], overrides: list[str]) -> None:
    """Refuse ``recover.rejoin=true`` given with ``recover.rejoin.<key>=...`` overrides.

    Hydra applies the short form by replacing the group's whole ``rejoin`` section with the
    bool, so a ``recover.rejoin.standbys=2`` before it would be dropped without a word (and
    one after it is refused by Hydra itself). ``overrides`` are the run's command-line
    overrides (``hydra.overrides.task``).
    """
    switch = raw.get("rejoin")
    if not isinstance(switch, bool):
        return
    lost = [o for o in overrides if o.lstrip("+~").startswith("recover.rejoin.")]
    if lost:
        word = str(switch).lower()
        raise ConfigurationError(
            f"recover.rejoin={word} replaces the whole recover.rejoin section, so {lost[0]} would be lost; "
            f"write recover.rejoin.enabled={word} instead of recover.rejoin={word}"
        )


def _schema_error(exc: OmegaConfBaseException, raw: dict[str, Any]) -> ConfigurationError:
    """OmegaConf's refusal of one value, in RecoverConfig's words (its message spans lines, names no fix)."""
    key = str(getattr(exc, "full_key", "") or "")
    path = key.split(".") if key else []
    if not path:
        # A section given a plain value (recover.rejoin=maybe) fails the merge with no key named.
        path = [name for name in ("checkpoint", "sdc", "rejoin") if name in raw and not isinstance(raw[name], dict)][:1]
    if path:
        # The refused value alone (e.g. {"checkpoint": {"every_n_steps": "x"}}), so that
        # RecoverConfig's check of that very field words the error.
        alone: Any = _lookup(raw, path)
        for part in reversed(path):
            alone = {part: alone}
        try:
            RecoverConfig.from_mapping(alone)
        except ConfigurationError as ours:
            return ours
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ConfigurationError(f"recover.{key or '<group>'} is refused by the RecoverConfig schema ({first}); fix that setting")


def _lookup(raw: dict[str, Any], path: list[str]) -> Any:
    value: Any = raw
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def fault_schedule(cfg: DictConfig, world_size: int | None = None) -> list[Any]:
    """``fault.schedule`` parsed by FaultSpec.parse (imports Lightning), ranks checked against the world."""
    from lightning_recover.callbacks.fault_injection import FaultSpec

    world = env_world_size() if world_size is None else world_size
    entries = OmegaConf.to_container(cfg.fault.schedule, resolve=True) if cfg.fault.get("schedule") is not None else []
    specs = []
    for i, entry in enumerate(entries):  # type: ignore[arg-type]
        try:
            specs.append(FaultSpec.parse(entry, i))  # type: ignore[arg-type]
        except ValueError as exc:
            raise ConfigurationError(f"{exc}; format: 'fault.schedule=[{{step:3,rank:2,phase:backward,kind:kill}}]'") from None
    for i, spec in enumerate(specs):
        if spec.rank >= world:
            raise ConfigurationError(
                f"fault.schedule[{i}].rank={spec.rank} but the job has {world} rank(s) (0..{world - 1}); "
                "pick an existing rank or launch more ranks"
            )
    max_steps = cfg.trainer.get("max_steps", -1)
    if max_steps > 0 and env_rank() == 0:
        for i, spec in enumerate(specs):
            if spec.step >= max_steps:
                print(
                    f"{PROG}: warning: fault.schedule[{i}].step={spec.step} is not below trainer.max_steps={max_steps}; "
                    "it will not fire",
                    file=sys.stderr,
                    flush=True,
                )
    return specs


# ---------------------------------------------------------------------- building blocks
def build_model(cfg: DictConfig) -> Any:
    """The GPT of ``cfg.model``, seeded first: every replica must start from the same weights."""
    import lightning as L
    from model import GPT, GPTConfig

    L.seed_everything(cfg.seed, verbose=False)
    fields = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "name"}  # type: ignore[union-attr]
    return GPT(GPTConfig(**fields))


def build_data(cfg: DictConfig) -> Any:
    """Map-style byte windows of the corpus (the strategy fetches microbatches by id)."""
    from model import ByteDataset, read_corpus

    corpus = None if cfg.data.corpus is None else str(cfg.data.corpus)
    data = read_corpus(corpus, max_bytes=cfg.data.max_bytes)
    window = cfg.model.block_size + 1
    if len(data) < window:
        raise ConfigurationError(
            f"data: the corpus gives {len(data)} bytes, fewer than one sample of model.block_size+1 = {window}; "
            "raise data.max_bytes or use a larger data.corpus"
        )
    return ByteDataset(data, cfg.model.block_size)


def check_dataset_size(cfg: DictConfig, recover: RecoverConfig, samples: int, world_size: int | None = None) -> None:
    """One optimizer step reads B * microbatch_size * shards samples (B = T * G_init)."""
    world = env_world_size() if world_size is None else world_size
    B = recover.microbatches_per_step(world)
    need = B * cfg.data.microbatch_size * recover.shards
    if samples < need:
        raise ConfigurationError(
            f"data: the corpus gives {samples} samples but one step needs B*microbatch_size*shards = "
            f"{B}*{cfg.data.microbatch_size}*{recover.shards} = {need}; raise data.max_bytes (or use a larger data.corpus), "
            "or lower data.microbatch_size, recover.grad_accum or recover.target_replicas"
        )


def build_strategy(recover: RecoverConfig) -> Any:
    """ReCoVerHSDPStrategy with these settings (already checked against the job by :func:`validate`)."""
    from lightning_recover.strategies import ReCoVerHSDPStrategy

    return ReCoVerHSDPStrategy(config=recover)


def build_loggers(run_dir: Path) -> list[Any]:
    """CSV always (``logs/version_N/metrics.csv``); TensorBoard too when it is installed."""
    loggers: list[Any] = [leader_csv_logger(run_dir)]
    if importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(run_dir, name="tb"))
    return loggers


def leader_csv_logger(run_dir: Path) -> Any:
    """CSV rows that survive a change of leader (see lightning_recover.callbacks.loggers)."""
    from lightning_recover.callbacks.loggers import LeaderCSVLogger

    return LeaderCSVLogger(run_dir, name="logs")


@functools.cache
def callback_classes() -> tuple[type, type]:
    """``(FirstStep, StepMetrics)``, defined on first use so that importing this file stays light."""
    from lightning.pytorch.callbacks import Callback
    from torchmetrics.aggregation import RunningMean, SumMetric

    class FirstStep(Callback):
        """Notes when the first optimizer step begins: errors before it are configuration errors."""

        def __init__(self) -> None:
            self.started = False

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.started = True

    class StepMetrics(Callback):
        """Per committed step, from the strategy's ``last_record``: perplexity and tokens/s.

        ``ppl`` = exp(committed step loss, the mean over the step's B microbatches);
        ``ppl_avg`` = exp(running mean over ``window`` steps). Tokens of a step = committed
        microbatches x microbatch_size x shards x block_size, so throughput counts only work
        that reached the optimizer (a spare's shadow work and recomputation after a failure
        are overhead); ``tokens_per_s`` uses the step's wall time, recovery included.
        torchmetrics keeps the running aggregates.
        """

        def __init__(self, tokens_per_microbatch: int, window: int = 10) -> None:
            self.tokens_per_microbatch = tokens_per_microbatch
            self.loss_window = RunningMean(window=window)
            self.tokens = SumMetric()
            self.seconds = SumMetric()
            self._last_step: int | None = None

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            rec = getattr(trainer.strategy, "last_record", None)
            if not rec or rec.get("step") == self._last_step:
                return
            self._last_step = rec["step"]
            loss = float(rec["loss"])
            tokens = int(rec["committed"]) * self.tokens_per_microbatch
            step_time = max(float(rec["step_time_s"]), 1e-9)
            self.loss_window.update(loss)
            self.tokens.update(float(tokens))
            self.seconds.update(step_time)
            metrics = {
                "ppl": math.exp(min(loss, 50.0)),
                "ppl_avg": math.exp(min(float(self.loss_window.compute()), 50.0)),
                "tokens_per_s": tokens / step_time,
                "tokens_per_s_avg": float(self.tokens.compute()) / float(self.seconds.compute()),
                "tokens": float(self.tokens.compute()),
                "recovery_s": float(rec.get("recovery_s", 0.0)),
            }
            for name, value in metrics.items():
                pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=name in ("ppl", "tokens_per_s"), rank_zero_only=True)

    return FirstStep, StepMetrics


def build_trainer(cfg: DictConfig, strategy: Any, callbacks: list[Any], run_dir: Path) -> Any:
    import lightning as L

    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(kwargs, dict)
    return L.Trainer(strategy=strategy, callbacks=callbacks, logger=build_loggers(run_dir), default_root_dir=str(run_dir), **kwargs)


def run_dir_of(cfg: DictConfig) -> Path:
    """Hydra's run directory (hydra.run.dir), shared by all ranks; the cwd without a Hydra run."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path.cwd()


def route_lightning_logs() -> None:
    """Lightning's messages go through Hydra's logging (console + pretrain.log) once, not twice.

    ``import lightning`` attaches its own console handler to the "lightning" logger; when
    Hydra has already configured the root logger, every message would print twice.
    """
    import lightning  # noqa: F401

    if logging.getLogger().handlers:
        logging.getLogger("lightning").handlers.clear()


# ---------------------------------------------------------------------- exits
def _leave(strategy: Any, code: int) -> NoReturn:
    """Exit. Once the strategy's communicator exists, through its shutdown (never hangs in MPI_Finalize)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if strategy is not None and getattr(strategy, "comm", None) is not None:
        strategy.shutdown(exit_code=code)
    if env_world_size() > 1:
        os._exit(code)
    sys.exit(code)


def _all_ranks_here(timeout_s: float = 15.0) -> bool:
    """Barrier over the launched job (bounded): no rank exits before the leader has printed.

    Open MPI ends the whole job as soon as one rank exits non-zero, which could kill rank 0
    before its message is out. False when the other ranks did not arrive in time.
    """
    import mpi4py

    mpi4py.rc.finalize = False  # only if MPI was not imported yet; never block in MPI_Finalize
    from mpi4py import MPI

    req = MPI.COMM_WORLD.Ibarrier()
    deadline = time.monotonic() + timeout_s
    while not req.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def usage_exit(message: str, strategy: Any = None) -> NoReturn:
    """One line on stderr (from rank 0 of a launched job), exit code 2 on every rank."""
    line = f"{PROG}: error: {' '.join(message.split())}"
    leader = env_rank() == 0
    if leader:
        print(line, file=sys.stderr, flush=True)
    if env_world_size() > 1:
        if not _all_ranks_here() and not leader:
            print(f"{line} (rank {env_rank()})", file=sys.stderr, flush=True)
        _leave(None, 2)
    _leave(strategy, 2)


def resolve_resume(cfg: DictConfig, recover: RecoverConfig) -> str | None:
    """``ckpt_path``: "last" -> the newest complete checkpoint in recover.checkpoint.dir."""
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is None:
        return None
    from lightning_recover.callbacks.checkpoint import resolve_ckpt_path

    return resolve_ckpt_path(str(ckpt_path), recover.checkpoint.dir)


def _is_policy_stop(exc: BaseException) -> bool:
    return any(t.__name__ == "TooFewReplicasError" for t in type(exc).__mro__)


def _is_ulfm_error(exc: BaseException) -> bool:
    return any(t.__name__ == "ULFMUnavailableError" for t in type(exc).__mro__)


# ---------------------------------------------------------------------- main
def train(cfg: DictConfig) -> None:
    """Validate, build, fit, print the leader's summary, and leave through strategy.shutdown."""
    strategy: Any = None
    first: Any = None
    recover: RecoverConfig | None = None
    try:
        recover = validate(cfg)
        specs = fault_schedule(cfg)  # imports Lightning
        import torch  # noqa: F401  (loaded here, after the cheap checks)
        from torch.utils.data import DataLoader

        from lightning_recover.callbacks import FaultInjection

        route_lightning_logs()
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        # On resume the strategy restores the sample order itself (planner state in the checkpoint).
        warnings.filterwarnings("ignore", ".*your dataloader is not resumable.*")
        FirstStep, StepMetrics = callback_classes()
        first = FirstStep()
        run_dir = run_dir_of(cfg)
        model = build_model(cfg)
        dataset = build_data(cfg)
        if hasattr(dataset, "__len__") and cfg.get("ckpt_path") is None:
            check_dataset_size(cfg, recover, len(dataset))
        ckpt_path = resolve_resume(cfg, recover)
        loader = DataLoader(dataset, batch_size=cfg.data.microbatch_size, shuffle=False)
        strategy = build_strategy(recover)
        tokens_per_mb = cfg.data.microbatch_size * recover.shards * cfg.model.block_size
        trainer = build_trainer(cfg, strategy, [first, FaultInjection(specs), StepMetrics(tokens_per_mb)], run_dir)
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    except SystemExit:
        raise
    except BaseException as exc:
        if _is_policy_stop(exc) and strategy is not None:
            # Too few live replicas to continue in place: a clear stop; relaunch with ckpt_path=last.
            if strategy.global_rank == 0:
                hint = "; relaunch with ckpt_path=last" if recover is not None and recover.checkpoint.enabled else ""
                print(f"{PROG}: stopping: {' '.join(str(exc).split())}{hint}", file=sys.stderr, flush=True)
            _leave(strategy, 3)
        if not (first is not None and first.started) and not os.environ.get("LR_TRACEBACK"):
            if _is_ulfm_error(exc):
                usage_exit(
                    "this launch has no MPI fault tolerance (ULFM); start the job with "
                    "'lightning-recover launch -n N -- python examples/pretrain.py ...' (or 'mpiexec --with-ft ulfm')",
                    strategy,
                )
            if isinstance(exc, (ValueError, FileNotFoundError)):
                usage_exit(str(exc), strategy)
        traceback.print_exc()
        # A rank that fails mid-run must not wait in MPI_Finalize for peers that are still training.
        _leave(None, 1)

    assert recover is not None
    if strategy.global_rank == 0:
        print(summary_line(recover, strategy, trainer.global_step), flush=True)
    strategy.shutdown(exit_code=0)


def summary_line(recover: RecoverConfig, strategy: Any, steps: int) -> str:
    record = strategy.last_record or {}
    loss = float(record.get("loss", float("nan")))
    comm = strategy.comm
    alive = len(comm.alive_replicas) if comm is not None else 1
    total = comm.layout.replicas if comm is not None else 1
    return (
        f"{PROG}: done: {steps} steps, final loss {loss:.4f} (ppl {math.exp(min(loss, 50.0)):.2f}), B={record.get('B')}, "
        f"faults {strategy.faults_seen}, live replicas {alive}/{total}, world epoch {record.get('world_epoch', 0)}, "
        f"ledger {recover.ledger_path}"
    )


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    from lightning_recover.runtime.slurm import refuse_direct_launch

    # Before Hydra creates the run directory and before MPI starts (run_stamp broadcasts over it):
    # a direct `srun -n N` start stops here on every task, leaving nothing behind.
    refuse_direct_launch()
    main()
