"""examples/pretrain.py: Hydra config composition, input validation (exit 2, one line), launched runs.

Validation runs are real single-process subprocesses (an MPI singleton, world size 1), all
started at once by one fixture; the launched runs use ``lightning-recover launch`` via
tests/harness/mpirun.py.
"""

from __future__ import annotations

import csv
import dataclasses
import inspect
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_recover.audit.ledger import read_ledger
from lightning_recover.audit.ledger_check import check_ledger
from lightning_recover.config import CheckpointConfig, ConfigurationError, RecoverConfig, RejoinConfig
from harness.mpirun import ROOT, run_mpi

EXAMPLES = ROOT / "examples"
CONF = EXAMPLES / "conf"
SCRIPT = "examples/pretrain.py"

from examples import pretrain  # noqa: E402


def cfg_of(*overrides: str, hydra_cfg: bool = False):  # type: ignore[no-untyped-def]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_cfg)


# ---------------------------------------------------------------------- composition
def test_defaults_compose() -> None:
    cfg = cfg_of()
    assert cfg.seed == 0
    assert cfg.model.name == "tiny"
    assert cfg.data.corpus is None and cfg.data.microbatch_size >= 1
    assert cfg.recover.policy == "static" and cfg.recover.shards == 1 and cfg.recover.target_replicas is None
    assert cfg.recover.grad_accum >= 1 and cfg.recover.min_replicas == 1
    assert OmegaConf.to_container(cfg.recover, resolve=False)["ledger_path"] == "${hydra:runtime.output_dir}/ledger.jsonl"
    assert list(cfg.fault.schedule) == []
    assert cfg.trainer.accumulate_grad_batches == 1 and cfg.trainer.precision == "32-true"
    assert cfg.ckpt_path is None and cfg.recover.checkpoint.every_n_steps == 0
    pretrain.validate(_with_ledger(cfg, None), world_size=4)


def _with_ledger(cfg, path):  # type: ignore[no-untyped-def]
    """``cfg`` with this ledger path, validated outside a Hydra run.

    Without a Hydra run the defaults' ``${hydra:runtime.output_dir}`` paths cannot be
    resolved, so a checkpoint directory still at its default is dropped too.
    """
    cfg = cfg.copy()
    cfg.recover.ledger_path = None if path is None else str(path)
    if str(OmegaConf.to_container(cfg.recover, resolve=False)["checkpoint"]["dir"]).startswith("${hydra:"):
        cfg.recover.checkpoint.dir = None
    return cfg


def test_public_overrides(tmp_path: Path) -> None:
    cfg = cfg_of(
        "model=small",
        "seed=7",
        "trainer.max_steps=6",
        "recover.shards=2",
        "recover.target_replicas=3",
        "recover.grad_accum=4",
        "recover.policy=adaptive",
        f"recover.ledger_path={tmp_path}/l.jsonl",
        f"data.corpus={tmp_path}",
        "fault.schedule=[{step:3,rank:2,phase:backward,kind:kill},{step:4,rank:5,phase:reduce,kind:hang,bucket:1}]",
        f"hydra.run.dir={tmp_path}/run",
        hydra_cfg=True,
    )
    assert cfg.model.name == "small" and cfg.seed == 7 and cfg.trainer.max_steps == 6
    assert (cfg.recover.shards, cfg.recover.target_replicas, cfg.recover.grad_accum) == (2, 3, 4)
    assert cfg.recover.policy == "adaptive"
    assert cfg.recover.ledger_path == f"{tmp_path}/l.jsonl"
    assert cfg.data.corpus == str(tmp_path)
    assert OmegaConf.to_container(cfg.fault.schedule) == [
        {"step": 3, "rank": 2, "phase": "backward", "kind": "kill"},
        {"step": 4, "rank": 5, "phase": "reduce", "kind": "hang", "bucket": 1},
    ]
    assert cfg.hydra.run.dir == f"{tmp_path}/run"
    assert cfg.hydra.job.chdir is False
    resume = cfg_of("++ckpt_path=last", "recover.checkpoint.every_n_steps=5", f"recover.checkpoint.dir={tmp_path}/ck")
    assert resume.ckpt_path == "last" and resume.recover.checkpoint.every_n_steps == 5
    assert resume.recover.checkpoint.dir == f"{tmp_path}/ck"


def test_run_dir_is_shared_and_only_the_leader_writes_hydra_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LR_RUN_STAMP", "2030-01-02/03-04-05")
    monkeypatch.setattr(pretrain, "_STAMP", None)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    cfg = cfg_of(hydra_cfg=True)
    assert cfg.hydra.run.dir == "runs/2030-01-02/03-04-05"
    assert cfg.hydra.output_subdir == ".hydra"
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert cfg.hydra.output_subdir is None


@pytest.mark.parametrize("size", ["tiny", "small", "base"])
def test_model_group_mirrors_model_sizes(size: str) -> None:
    from examples.model import SIZES, GPTConfig

    cfg = cfg_of(f"model={size}")
    for key, value in SIZES[size].items():
        assert cfg.model[key] == value, key
    assert set(pretrain.MODEL_FIELDS) == {f.name for f in dataclasses.fields(GPTConfig)}
    assert set(cfg.model) - {"name"} <= set(pretrain.MODEL_FIELDS)


def test_tiny_keeps_model_defaults_but_dropout() -> None:
    # The tiny config is the test/demo model: GPTConfig defaults except dropout 0.
    from examples.model import GPTConfig

    cfg = cfg_of()
    defaults = GPTConfig()
    assert (cfg.model.lr, cfg.model.weight_decay, cfg.model.warmup_steps) == (defaults.lr, defaults.weight_decay, defaults.warmup_steps)
    assert cfg.model.dropout == 0.0


def test_trainer_group_holds_only_trainer_arguments() -> None:
    from lightning import Trainer

    params = inspect.signature(Trainer.__init__).parameters
    assert set(cfg_of().trainer) <= set(params)


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"step": 1, "rank": 0, "phase": "forward", "kind": "melt"}, "kind='melt' is not one of ('kill', 'hang', 'stuck', 'term', 'corrupt', 'host_ranks_kill'"),
        ({"step": 1, "rank": 0, "phase": "checkpoint", "kind": "stuck"}, "kind=stuck at phase=checkpoint"),
        ({"step": -1, "rank": 0, "phase": "forward"}, "step=-1 must be a non-negative integer"),
        ({"rank": 0, "phase": "forward"}, "missing 'step'"),
    ],
)
def test_fault_spec_errors_name_the_entry(entry: dict, needle: str) -> None:
    from lightning_recover.callbacks import FaultSpec

    with pytest.raises(ValueError, match=re.escape(needle)):
        FaultSpec.parse(entry, 0)
    assert FaultSpec.parse({"step": 4, "rank": 0, "phase": "checkpoint", "kind": "kill"}).phase == "checkpoint"


def test_named_fault_schedule_parses() -> None:
    cfg = cfg_of("fault=two_kills")
    specs = pretrain.fault_schedule(cfg, world_size=4)
    assert [(s.step, s.rank, s.phase) for s in specs] == [(3, 2, "backward"), (6, 3, "reduce")]


@pytest.mark.parametrize(
    ("overrides", "world", "needle"),
    [
        (["recover.policy=bogus"], 4, "recover.policy='bogus'"),
        (["recover.grad_accum=0"], 4, "recover.grad_accum=0"),
        (["recover.shards=3"], 4, "recover.shards=3 does not divide the world size 4"),
        (["recover.target_replicas=5"], 4, "recover.target_replicas=5"),
        (["recover.policy=adaptive", "recover.target_replicas=2"], 4, "set recover.target_replicas=null"),
        (["recover.min_replicas=3", "recover.shards=2"], 4, "recover.min_replicas=3"),
        (["trainer.precision=16-mixed"], 4, "trainer.precision='16-mixed'"),
        (["trainer.accumulate_grad_batches=2"], 4, "trainer.accumulate_grad_batches=2"),
        (["fault.schedule=oops"], 4, "fault.schedule='oops' is not a list"),
        (["data.corpus=/no/such/corpus"], 4, "data.corpus='/no/such/corpus' does not exist"),
        (["model.n_head=3"], 4, "model.n_embd=32 is not divisible by model.n_head=3"),
        (["recover.checkpoint.every_n_steps=-1"], 4, "recover.checkpoint.every_n_steps=-1"),
        (["ckpt_path=/no/such/step-3.ckpt"], 4, "ckpt_path='/no/such/step-3.ckpt' is not a checkpoint file"),
        (["recover.hang_timeout_s=-2"], 4, "recover.hang_timeout_s=-2"),
    ],
)
def test_validate_names_the_value(overrides: list[str], world: int, needle: str) -> None:
    cfg = _with_ledger(cfg_of(*overrides), None)
    cfg.recover.checkpoint.dir = None
    with pytest.raises(ConfigurationError) as info:
        pretrain.validate(cfg, world_size=world)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_resume_defers_b_to_the_checkpoint(tmp_path: Path) -> None:
    # Resuming on fewer replicas than the checkpoint's T: B, G_init and T come from the checkpoint.
    cfg = _with_ledger(cfg_of("recover.target_replicas=4", "++ckpt_path=last", f"recover.checkpoint.dir={tmp_path}"), None)
    pretrain.validate(cfg, world_size=2)
    with pytest.raises(ConfigurationError, match="recover.target_replicas=4"):
        pretrain.validate(_with_ledger(cfg_of("recover.target_replicas=4"), None), world_size=2)


def test_recover_group_is_typed_by_recover_config() -> None:
    # The group sets every RecoverConfig field but seed (the top-level seed seeds everything).
    group = OmegaConf.to_container(cfg_of().recover, resolve=False)
    assert isinstance(group, dict)
    assert set(group) == {f.name for f in dataclasses.fields(RecoverConfig)} - {"seed"}
    assert set(group["checkpoint"]) == {f.name for f in dataclasses.fields(CheckpointConfig)}
    assert set(group["rejoin"]) == {f.name for f in dataclasses.fields(RejoinConfig)}
    schema = pretrain.recover_schema()
    assert OmegaConf.get_type(schema) is RecoverConfig
    assert OmegaConf.get_type(schema.checkpoint) is CheckpointConfig
    assert OmegaConf.get_type(schema.rejoin) is RejoinConfig
    # The YAML's values are the dataclass's defaults (recover.rejoin=true keeps them: it replaces the section).
    assert RejoinConfig(**group["rejoin"]) == RejoinConfig()


def test_recover_config_is_built_once_from_the_group(tmp_path: Path) -> None:
    ledger = tmp_path / "run" / "ledger.jsonl"
    overrides = ["seed=7", "recover.shards=2", "recover.target_replicas=3", "recover.grad_accum=4", "recover.hang_timeout_s=5",
                 "recover.bucket_mb=1", "recover.shards='2'", "recover.checkpoint.every_n_steps=2", f"recover.checkpoint.dir={tmp_path}/ck"]
    cfg = _with_ledger(cfg_of(*overrides), ledger)
    expected = RecoverConfig(
        shards=2, grad_accum=4, target_replicas=3, min_replicas=1, bucket_mb=1.0, ledger_path=str(ledger), seed=7,
        hang_timeout_s=5.0, checkpoint=CheckpointConfig(dir=f"{tmp_path}/ck", every_n_steps=2),
    )
    config = pretrain.recover_config(cfg)
    assert config == expected
    # Typed by the schema: a quoted number is a number, an int given for a float field a float.
    assert type(config.shards) is int and type(config.bucket_mb) is float and type(config.hang_timeout_s) is float
    assert pretrain.validate(cfg, world_size=8) == expected  # 4 replicas: T = 3 fits
    assert (tmp_path / "ck").is_dir() and not ledger.exists()  # probed, nothing left behind
    # Resuming: T comes from the checkpoint, so the strategy gets none.
    resumed = _with_ledger(cfg_of(*overrides, "++ckpt_path=last"), ledger)
    assert pretrain.validate(resumed, world_size=2) == dataclasses.replace(expected, target_replicas=None)


@pytest.mark.parametrize(
    "overrides",
    [
        ["recover.rejoin.enabled=true", "recover.rejoin.standbys=2", "recover.rejoin.hosts=node7"],  # the section
        ["recover.rejoin=true", "+recover.rejoin_standbys=2", "+recover.rejoin_hosts=node7"],  # the short form
        ["recover.rejoin.enabled=true", "+recover.rejoin_standbys=2", "+recover.rejoin_hosts=node7"],  # a flat key wins
    ],
)
def test_rejoin_overrides_in_either_spelling_give_equal_configs(overrides: list[str]) -> None:
    config = pretrain.recover_config(_with_ledger(cfg_of(*overrides), None))
    assert config.rejoin == RejoinConfig(enabled=True, standbys=2, hosts="node7")
    assert config == RecoverConfig(grad_accum=2, rejoin=RejoinConfig(enabled=True, standbys=2, hosts="node7"))


def test_the_short_switch_never_drops_section_overrides_silently() -> None:
    # Hydra turns recover.rejoin=true into a bool in place of the section: recover.rejoin.standbys=2
    # given before it would be gone, so the run refuses that pair (pretrain reads the run's overrides).
    raw = {"rejoin": True}
    with pytest.raises(ConfigurationError, match=re.escape(
        "recover.rejoin=true replaces the whole recover.rejoin section, so recover.rejoin.standbys=2 would be lost; "
        "write recover.rejoin.enabled=true instead of recover.rejoin=true"
    )):
        pretrain.refuse_replaced_section(raw, ["recover.rejoin.standbys=2", "recover.rejoin=true"])
    pretrain.refuse_replaced_section(raw, ["recover.rejoin=true", "+recover.rejoin_standbys=2"])  # the short forms together
    pretrain.refuse_replaced_section({"rejoin": {"enabled": True}}, ["recover.rejoin.enabled=true", "recover.rejoin.standbys=2"])


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("recover.grad_accum=abc", ["grad_accum must be an integer", "recover.grad_accum='abc'", "set recover.grad_accum"]),
        ("recover.target_replicas=2.5", ["target_replicas must be an integer", "recover.target_replicas=2.5"]),
        ("recover.hang_timeout_s=true", ["recover.hang_timeout_s=True", "set recover.hang_timeout_s"]),
        ("recover.bucket_mb=big", ["recover.bucket_mb='big'", "set recover.bucket_mb"]),
        ("recover.bucket_mb=0", ["recover.bucket_mb=0.0", "set recover.bucket_mb"]),
        ("recover.timeout_s=-1", ["recover.timeout_s=-1.0", "set recover.timeout_s"]),
        ("recover.stuck_timeout_s=-3", ["recover.stuck_timeout_s=-3.0", "set recover.stuck_timeout_s"]),
        ("recover.policy=[static]", ["unknown policy", "recover.policy=[", "recover.policy=static"]),
        ("recover.checkpoint.every_n_steps=often", ["recover.checkpoint.every_n_steps='often'", "0 for no checkpoints"]),
        ("+recover.bucket_size=3", ["recover.bucket_size is not a recover setting", "bucket_mb"]),
        ("+recover.checkpoint.keep=3", ["recover.checkpoint.keep is not a recover.checkpoint setting", "every_n_steps"]),
        ("+recover.seed=3", ["recover.seed=3", "use seed=N"]),
        ("recover.checkpoint.every_n_steps=2", ["recover.checkpoint.every_n_steps=2 > 0 needs recover.checkpoint.dir"]),
        ("+recover.rejoin.standby=1", ["recover.rejoin.standby is not a recover.rejoin setting; did you mean standbys?",
                                       "remove it or use one of: enabled, hosts"]),
        ("recover.rejoin.standbys=-1", ["rejoin.standbys must be >= 0, got -1 (recover.rejoin.standbys=-1)", "set recover.rejoin.standbys"]),
        ("recover.rejoin.attempts=many", ["rejoin.attempts must be an integer, got 'many'", "set recover.rejoin.attempts"]),
        ("+recover.rejoin_standbys=-1", ["rejoin.standbys must be >= 0, got -1", "set recover.rejoin.standbys"]),
        ("recover.rejoin=maybe", ["recover.rejoin='maybe' is not a RejoinConfig", "pass rejoin=True/False"]),
    ],
)
def test_recover_type_and_key_errors_name_the_value(override: str, needles: list[str]) -> None:
    # OmegaConf's own refusals (types, unknown keys) come out as RecoverConfig's one-liners.
    with pytest.raises(ConfigurationError) as info:
        pretrain.validate(_with_ledger(cfg_of(override), None), world_size=4)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_unresolved_hydra_paths_are_named() -> None:
    # Composed without a Hydra run, ${hydra:runtime.output_dir} has no value: say which setting to give.
    with pytest.raises(ConfigurationError, match=r"recover.ledger_path cannot be resolved .*set recover.ledger_path explicitly"):
        pretrain.validate(cfg_of(), world_size=1)


def test_fault_schedule_rank_must_exist() -> None:
    cfg = cfg_of("fault.schedule=[{step:1,rank:4,phase:backward}]")
    with pytest.raises(ConfigurationError, match=r"fault.schedule\[0\].rank=4 but the job has 4 rank"):
        pretrain.fault_schedule(cfg, world_size=4)


def test_dataset_size_check() -> None:
    cfg = cfg_of("recover.grad_accum=2", "data.microbatch_size=4")
    recover = pretrain.recover_config(_with_ledger(cfg, None))
    pretrain.check_dataset_size(cfg, recover, 32, world_size=4)  # B = 8, 8 * 4 = 32 samples: enough
    with pytest.raises(ConfigurationError, match=r"31 samples but one step needs B\*microbatch_size\*shards = 8\*4\*1 = 32"):
        pretrain.check_dataset_size(cfg, recover, 31, world_size=4)


def test_ledger_path_test_write_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "new" / "ledger.jsonl"
    pretrain.check_ledger_path(str(target))
    assert not target.exists()
    existing = tmp_path / "old.jsonl"
    existing.write_text('{"step": 0}\n')
    pretrain.check_ledger_path(str(existing))
    assert existing.read_text() == '{"step": 0}\n'


# ---------------------------------------------------------------------- exit code 2, one line
ITERABLE_DRIVER = """
import os
import sys
os.chdir({workdir!r})  # without a Hydra run, the run directory is the cwd
from examples import pretrain
from hydra import compose, initialize_config_dir
from torch.utils.data import IterableDataset

class Stream(IterableDataset):
    def __init__(self, ds):
        self.ds = ds
    def __iter__(self):
        return (self.ds[i] for i in range(len(self.ds)))

build = pretrain.build_data
pretrain.build_data = lambda cfg: Stream(build(cfg))
with initialize_config_dir(config_dir={conf!r}, version_base="1.3"):
    # No Hydra run here, so the defaults' ${{hydra:...}} paths are replaced.
    cfg = compose("config", overrides=["recover.ledger_path={ledger}", "recover.checkpoint.dir=null", "trainer.max_steps=1",
                                       "data.max_bytes=20000"])
pretrain.train(cfg)
"""

BAD_RUNS: dict[str, tuple[list[str], str]] = {
    # name: (overrides, text the one line must contain)
    "policy": (["recover.policy=bogus"], "recover.policy='bogus'"),
    "grad_accum": (["recover.grad_accum=0"], "recover.grad_accum=0"),
    "grad_accum_type": (["recover.grad_accum=abc"], "recover.grad_accum='abc'"),
    "unknown_key": (["+recover.bucket_size=3"], "recover.bucket_size is not a recover setting"),
    "fault_schedule": (["fault.schedule=[{step:1,rank:0,phase:sideways,kind:kill}]"], "phase='sideways'"),
    "corpus": (["data.corpus=/no/such/corpus"], "data.corpus='/no/such/corpus'"),
    "ledger": (["recover.ledger_path={tmp}/afile/ledger.jsonl"], "recover.ledger_path="),
    "shards": (["recover.shards=2"], "recover.shards=2 does not divide the world size 1"),
    "target_replicas": (["recover.target_replicas=2"], "recover.target_replicas=2"),
    "accumulate": (["trainer.accumulate_grad_batches=4"], "trainer.accumulate_grad_batches=4"),
    "fp16": (["trainer.precision=16-mixed"], "trainer.precision='16-mixed'"),
    "too_small": (["data.max_bytes=200"], "one step needs B*microbatch_size*shards = 2*4*1 = 8"),
}
BAD_RUNS["no_checkpoint"] = (["ckpt_path=last", "recover.checkpoint.dir={tmp}/empty"], "holds no complete checkpoint")
SPECIAL = {
    "iterable": "is not map-style",
    "no_ulfm": "no MPI fault tolerance (ULFM)",
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Start every bad-input run at once (they mostly wait on imports), then collect them."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "afile").write_text("not a directory\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in [k for k in env if k.startswith(("OMPI_", "PMIX_"))]:
        del env[key]
    cmds: dict[str, list[str]] = {}
    for name, (overrides, _) in BAD_RUNS.items():
        args = [o.replace("{tmp}", str(tmp)) for o in overrides]
        cmds[name] = [sys.executable, SCRIPT, *args, f"hydra.run.dir={tmp / name}"]
    driver = tmp / "iterable_driver.py"
    (tmp / "it").mkdir()
    driver.write_text(
        ITERABLE_DRIVER.format(conf=str(CONF), workdir=str(tmp / "it"), ledger=str(tmp / "it" / "ledger.jsonl"))
    )
    cmds["iterable"] = [sys.executable, str(driver)]
    # Plain mpiexec, without --with-ft ulfm: the job must refuse to start.
    from lightning_recover.cli.mpiexec import find_mpiexec, launch_env

    cmds["no_ulfm"] = [find_mpiexec(), "-n", "2", sys.executable, SCRIPT, "trainer.max_steps=1", f"hydra.run.dir={tmp / 'noft'}"]
    procs = {
        name: subprocess.Popen(
            cmd, cwd=ROOT, env=launch_env(env) if name == "no_ulfm" else env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )
        for name, cmd in cmds.items()
    }
    results = {}
    deadline = time.monotonic() + 150
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            err += "\n<timed out>"
        results[name] = subprocess.CompletedProcess(cmds[name], proc.returncode, out, err)
    return results


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("pretrain.py: error:")]


@pytest.mark.parametrize("name", [*BAD_RUNS, *SPECIAL])
def test_bad_input_exits_2_with_one_line(bad_runs: dict[str, subprocess.CompletedProcess], name: str) -> None:
    res = bad_runs[name]
    detail = f"rc={res.returncode}\n--- stderr ---\n{res.stderr[-3000:]}"
    assert res.returncode == 2, detail
    assert "Traceback" not in res.stderr, detail
    lines = error_lines(res.stderr)
    assert len(lines) == 1, detail
    needle = BAD_RUNS[name][1] if name in BAD_RUNS else SPECIAL[name]
    assert needle in lines[0], detail
    assert "done:" not in res.stdout


def test_single_process_errors_are_the_only_stderr_line(bad_runs: dict[str, subprocess.CompletedProcess]) -> None:
    # Checks that need no model (everything but the fault schedule and dataset size) stop
    # before torch and Lightning load: the error is all there is on stderr.
    for name in ("policy", "grad_accum", "grad_accum_type", "unknown_key", "corpus", "ledger", "shards", "target_replicas", "accumulate", "fp16"):
        assert bad_runs[name].stderr.strip().splitlines() == error_lines(bad_runs[name].stderr), name


# ---------------------------------------------------------------------- launched runs
def metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    path = next(run_dir.glob("logs/version_*/metrics.csv"))
    return list(csv.DictReader(path.open()))


QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """2 replicas x grad_accum 4 (B = 8), fault-free, 3 steps."""
    tmp = tmp_path_factory.mktemp("two")
    run = tmp / "run"
    job = run_mpi(
        2, [SCRIPT, "model=tiny", "trainer.max_steps=3", "recover.grad_accum=4", "seed=3", *QUIET, f"hydra.run.dir={run}"], tmp, timeout=150
    )
    return job, run


@pytest.mark.mpi
def test_launched_two_ranks(two_ranks) -> None:  # type: ignore[no-untyped-def]
    job, run = two_ranks
    assert job.returncode == 0, job.describe()
    ledger = read_ledger(run / "ledger.jsonl")
    assert [line["step"] for line in ledger] == [0, 1, 2], job.describe()
    assert all(line["B"] == 8 for line in ledger)  # 2 replicas x grad_accum 4
    verdict = check_ledger(run / "ledger.jsonl")
    assert verdict.ok, verdict.problems
    summary = [line for line in job.stdout.splitlines() if line.startswith("pretrain.py: done:")]
    assert len(summary) == 1 and "3 steps" in summary[0] and "faults 0" in summary[0], job.describe()
    assert (run / ".hydra" / "config.yaml").exists()
    rows = [r for r in metrics_rows(run) if r.get("step_loss")]
    assert len(rows) == 3
    for key in ("ppl", "tokens_per_s", "live_replicas", "world_epoch", "faults"):
        assert rows[-1][key], key
    # tokens of a step = B * microbatch_size * shards * block_size = 8 * 4 * 1 * 32
    assert float(rows[-1]["tokens"]) == 3 * 8 * 4 * 32


@pytest.mark.mpi
def test_launched_four_ranks_with_a_kill_follows_the_two_rank_trajectory(tmp_path: Path, two_ranks) -> None:  # type: ignore[no-untyped-def]
    # Same seed and B = 8 (4 replicas x 2 microbatches): the same samples in the same steps,
    # through the loss of replica 2 in step 1.
    _, ref = two_ranks
    run = tmp_path / "run"
    job = run_mpi(
        4,
        [SCRIPT, "model=tiny", "trainer.max_steps=3", "recover.grad_accum=2", "seed=3", *QUIET,
         "fault.schedule=[{step:1,rank:2,phase:backward,kind:kill}]", f"hydra.run.dir={run}"],
        tmp_path,
        timeout=180,
    )
    ledger = read_ledger(run / "ledger.jsonl")
    assert [line["step"] for line in ledger] == [0, 1, 2], job.describe()
    assert ledger[1]["faults"] == [2] and ledger[1]["world_epoch"] == 1
    verdict = check_ledger(run / "ledger.jsonl", reference=ref / "ledger.jsonl", rtol=1e-4)
    assert verdict.ok, f"{verdict.problems}\n{job.describe()}"
    summary = [line for line in job.stdout.splitlines() if line.startswith("pretrain.py: done:")]
    assert len(summary) == 1 and "faults 1" in summary[0] and "live replicas 3/4" in summary[0], job.describe()


@pytest.mark.mpi
def test_leader_losses_then_stop_below_min_replicas_then_resume(tmp_path: Path, two_ranks) -> None:  # type: ignore[no-untyped-def]
    # 3 replicas, T = 2, grad_accum 4 (B = 8; replica 2 is a spare), a checkpoint every step,
    # at least 2 live replicas. Step 1: the leader (rank 0) dies, the spare takes its ids and
    # rank 1 leads. Step 2: rank 1 dies too -> one replica left: the job stops (exit 3, one
    # line). One rank resumes from the checkpoint with B = 8: the ledger follows the
    # fault-free two-rank run, and metrics.csv keeps the rows every leader wrote.
    _, ref = two_ranks
    run = tmp_path / "run"
    common = ["model=tiny", "trainer.max_steps=3", "seed=3", *QUIET, f"hydra.run.dir={run}"]
    stop = run_mpi(
        3,
        [SCRIPT, *common, "recover.target_replicas=2", "recover.grad_accum=4", "recover.min_replicas=2",
         # Each leader dies in the step right after a checkpoint: a background write would die with it
         # (the previous checkpoint stays, tested in test_strategy_mpi), so these are written synchronously.
         "recover.checkpoint.every_n_steps=1", "recover.checkpoint.async_save=false",
         "fault.schedule=[{step:1,rank:0,phase:backward,kind:kill},{step:2,rank:1,phase:backward,kind:kill}]"],
        tmp_path / "stop",
        timeout=150,
    )
    assert stop.returncode == 3, stop.describe()
    stops = [line for line in stop.stderr.splitlines() if line.startswith("pretrain.py: stopping:")]
    assert len(stops) == 1 and "min_replicas=2" in stops[0] and "ckpt_path=last" in stops[0], stop.describe()
    assert "Traceback" not in stop.stderr, stop.describe()
    ledger = read_ledger(run / "ledger.jsonl")
    assert [line["step"] for line in ledger] == [0, 1] and ledger[1]["faults"] == [0], stop.describe()
    steps = [int(r["step"]) for r in metrics_rows(run) if r.get("step_loss")]
    assert steps == [0, 1], f"rows of the first leader lost: {steps}"
    assert (run / "checkpoints" / "last.ckpt").exists()

    resumed = run_mpi(1, [SCRIPT, *common, "++ckpt_path=last"], tmp_path / "resume", timeout=150)
    assert resumed.returncode == 0, resumed.describe()
    ledger = read_ledger(run / "ledger.jsonl")
    assert [line["step"] for line in ledger] == [0, 1, 2] and ledger[-1]["B"] == 8, resumed.describe()
    verdict = check_ledger(run / "ledger.jsonl", reference=ref / "ledger.jsonl", rtol=1e-4)
    assert verdict.ok, f"{verdict.problems}\n{resumed.describe()}"
    assert any(line.startswith("pretrain.py: done: 3 steps") for line in resumed.stdout.splitlines()), resumed.describe()
