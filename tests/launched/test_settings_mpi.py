"""Every way a user passes settings gives one line naming the key and the fix, and exit status 2 (issue 34, point 2).

``tests/workers/settings_script.py`` passes ReCoVerHSDPStrategy one bad setting per case:
keywords, nested groups from YAML through Hydra's ``instantiate`` (a bare TypeError before),
DictConfig / ListConfig values, ``config=`` given a dict (an AttributeError before) or a
DictConfig, and a Trainer setting the strategy refuses with ``strategy="recover_hsdp"`` (after
MPI is up). The test asserts what the user reads: exit status 2, one line holding the key, no
traceback, no line about ranks that outlived mpiexec.

Every case refused by the strategy's constructor takes one path to the user (a
ConfigurationError, the refusal's one line, status 2): a keyword and a Hydra group run as
launched jobs on 2 ranks under ``lightning-recover launch`` (all at once: they mostly wait on
imports), the other constructor cases check their line in-process, through the same script
function; the Trainer setting refused after MPI is up is launched too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness.mpirun import MPIJob, run_mpi

SCRIPT = "tests/workers/settings_script.py"
PREFIX = "[lightning-recover] configuration error: "

#: case -> what the one line must contain (the key, as the user wrote it, and the fix).
CASES: dict[str, str] = {
    "keyword_unknown": "recover.grad_acum is not a recover setting; did you mean grad_accum?",
    "keyword_value": "grad_accum must be >= 1, got 0 (recover.grad_accum=0); set recover.grad_accum to a positive integer",
    "nested_checkpoint": "recover.checkpoint.every_n_step is not a recover.checkpoint setting; did you mean every_n_steps?",
    "nested_sdc": "sdc.action must be 'repair' or 'evict', got 'fix' (recover.sdc.action='fix'); set recover.sdc.action=repair",
    "both_forms": "both checkpoint=... and checkpoint_dir set recover.checkpoint; pass the group once",
    "listconfig": "rejoin.hosts must be a comma-separated host list, got ['node7', 'node8'] (recover.rejoin.hosts=",
    "config_dict": "recover.polcy is not a recover setting; did you mean policy?",
    "config_dictconfig": "shards must be a positive integer, got 0 (recover.shards=0)",
    "strategy_string": "accumulate_grad_batches=2: ReCoVerHSDPStrategy accumulates itself; remove accumulate_grad_batches",
}


#: The cases launched: one per path a refusal takes to the user (the rest: in-process, below).
LAUNCHED = ("keyword_unknown", "nested_sdc", "strategy_string")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MPIJob]:
    tmp = tmp_path_factory.mktemp("settings")
    names = [*LAUNCHED, "good"]
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {name: pool.submit(run_mpi, 2, [SCRIPT, "--case", name], tmp / name, timeout=300) for name in names}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.mpi
@pytest.mark.parametrize("case", LAUNCHED)
def test_a_bad_setting_is_one_line_and_exit_status_2(jobs: dict[str, MPIJob], case: str) -> None:
    job = jobs[case]
    assert job.returncode == 2, job.describe()
    assert "Traceback" not in job.stderr and "TypeError" not in job.stderr and "AttributeError" not in job.stderr, job.describe()
    lines = [line for line in job.stderr.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 1, job.describe()
    assert CASES[case] in lines[0], job.describe()
    assert "outlived mpiexec" not in job.stderr, job.describe()
    assert "the program raised" not in job.stderr, job.describe()
    assert "trained" not in job.stdout, job.describe()


@pytest.mark.parametrize("case", [c for c in CASES if c not in LAUNCHED])
def test_every_other_bad_setting_names_its_key_and_fix(case: str, tmp_path: Path) -> None:
    # What the launched ranks print: the refusal's line for the ConfigurationError the script raised
    # (through Hydra's InstantiationException for a YAML group), as the refusal hook finds it.
    from settings_script import strategy_for

    from lightning_recover.runtime.refusal import configuration_error, refusal_line

    with pytest.raises(Exception) as info:
        strategy_for(case, str(tmp_path))
    error = configuration_error(info.value)
    assert error is not None, info.value
    line = refusal_line(error)
    assert line.startswith(PREFIX) and CASES[case] in line and "\n" not in line, line


@pytest.mark.mpi
def test_nested_groups_from_yaml_are_accepted(jobs: dict[str, MPIJob]) -> None:
    job = jobs["good"]
    assert job.returncode == 0, job.describe()
    trained = [line for line in job.stdout.splitlines() if line.startswith("settings_script:")]
    assert len(trained) == 2 and all("trained 1 step(s) with SDCConfig(every_n_steps=1, action='repair')" in t for t in trained), job.describe()
    assert PREFIX not in job.stderr, job.describe()
