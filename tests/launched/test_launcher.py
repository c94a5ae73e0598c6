"""The launcher and the ``lightning-recover`` command line."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_recover.cli import commands as cli
from lightning_recover.cli.job_status import JobMarkers, final_words
from lightning_recover.cli.mpiexec import build_command, chooses_coll, detector_flags, find_mpiexec, launch_env, safe_coll_note, spans_hosts
from lightning_recover.cli.runner import run_supervised

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = "/opt/mpi/bin/mpiexec"


def _mca(argv: list[str]) -> dict[str, str]:
    """``--mca KEY VALUE`` pairs of an argv."""
    return {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--mca"}


# ------------------------------------------------------------------------------ build_command
def test_basic_command() -> None:
    argv = build_command(4, ["python", "train.py", "--lr", "1e-3"], cores=8, mpiexec=MPIEXEC)
    assert argv == [
        MPIEXEC, "--with-ft", "ulfm", "--prtemca", "state_base_recoverable", "1", "-n", "4", "--mca", "coll", "^han,cuda",
        "python", "train.py", "--lr", "1e-3",
    ]


@pytest.mark.parametrize(
    ("extra", "env", "coll"),
    [
        ((), {}, "^han,cuda"),  # the default, on one host as on several
        (("--mca", "coll", "^cuda"), {}, "^cuda"),  # the user's own choice is kept, ours not added
        (("-mca", "coll", "tuned,basic,self,libnbc,ftagree"), {}, "tuned,basic,self,libnbc,ftagree"),
        ((), {"OMPI_MCA_coll": "^cuda"}, None),  # chosen in the environment: nothing on the command line overrides it
    ],
)
def test_han_and_cuda_collectives_left_out_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch, extra: tuple[str, ...], env: dict[str, str], coll: str | None
) -> None:
    monkeypatch.delenv("OMPI_MCA_coll", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = build_command(2, ["x"], cores=2, mpiexec=MPIEXEC, extra=extra)
    values = [argv[i + 2] for i, a in enumerate(argv) if a in ("--mca", "-mca") and argv[i + 1] == "coll"]
    assert values == ([] if coll is None else [coll]), argv
    assert "--mca" not in build_command(2, ["x"], cores=2, mpiexec=MPIEXEC, safe_coll=False)


def test_the_han_note_only_when_ranks_span_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMPI_MCA_coll", raising=False)
    one = build_command(4, ["x"], mpiexec=MPIEXEC, hosts="a:4", slots=4)
    two = build_command(4, ["x"], mpiexec=MPIEXEC, hosts="a:2,b:2", slots=4)
    hostfile = build_command(4, ["x"], mpiexec=MPIEXEC, extra=["--hostfile", "hosts.txt"])
    own = build_command(4, ["x"], mpiexec=MPIEXEC, hosts="a:2,b:2", slots=4, extra=["--mca", "coll", "^cuda"])
    assert not spans_hosts(one) and spans_hosts(two) and spans_hosts(hostfile)
    assert safe_coll_note(one) is None and safe_coll_note(own) is None
    note = safe_coll_note(two)
    assert note is not None and safe_coll_note(hostfile) == note
    assert "13915" in note and "--mpi-arg=--mca --mpi-arg=coll --mpi-arg=LIST" in note and "OMPI_MCA_coll=LIST" in note
    assert chooses_coll(["--mca", "coll", "^cuda"], {}) and chooses_coll([], {"OMPI_MCA_coll": "x"})
    assert not chooses_coll(["--mca", "coll_tuned_use_dynamic_rules", "1"], {})


@pytest.mark.parametrize(("n", "cores", "over"), [(1, 1, False), (2, 2, False), (3, 2, True), (4, 2, True), (16, 64, False), (65, 64, True)])
def test_oversubscribe_only_when_more_ranks_than_cores(n: int, cores: int, over: bool) -> None:
    argv = build_command(n, ["x"], cores=cores, mpiexec=MPIEXEC)
    assert ("--oversubscribe" in argv) == over
    assert argv[argv.index("-n") + 1] == str(n)
    assert argv[-1] == "x", "the user's command comes last, untouched"


def test_oversubscribe_defaults_to_this_machines_cores() -> None:
    cores = os.cpu_count() or 1
    assert "--oversubscribe" not in build_command(cores, ["x"], mpiexec=MPIEXEC)
    assert "--oversubscribe" in build_command(cores + 1, ["x"], mpiexec=MPIEXEC)


def test_ft_is_always_on() -> None:
    argv = build_command(2, ["x"], cores=2, mpiexec=MPIEXEC)
    i = argv.index("--with-ft")
    assert argv[i + 1] == "ulfm"


def test_no_detector_without_hang_timeout() -> None:
    argv = build_command(2, ["x"], cores=2, mpiexec=MPIEXEC)
    assert not any("detector" in a for a in argv)


@pytest.mark.parametrize(("timeout", "period"), [(4, "1"), (10, "1"), (2, "0.5"), (0.2, "0.1"), (0.1, "0.1")])
def test_detector_flags_with_hang_timeout(timeout: float, period: str) -> None:
    argv = build_command(2, ["python", "t.py"], cores=2, mpiexec=MPIEXEC, hang_timeout=timeout)
    mca = {k: v for k, v in _mca(argv).items() if k != "coll"}
    assert mca == {
        "mpi_ft_detector": "true",
        "mpi_ft_detector_thread": "true",
        "mpi_ft_detector_period": period,
        "mpi_ft_detector_timeout": f"{timeout:g}",
    }
    # The period never exceeds the timeout, so a hang is caught within about one timeout.
    assert float(mca["mpi_ft_detector_period"]) <= timeout
    # mpiexec options all precede the user's command.
    assert argv[-2:] == ["python", "t.py"]
    assert argv.index("--mca") < argv.index("python")


@pytest.mark.parametrize("bad", [0, -1, -0.5])
def test_bad_hang_timeout_named(bad: float) -> None:
    with pytest.raises(ValueError, match=rf"--hang-timeout must be > 0 seconds, got {bad:g}"):
        build_command(2, ["x"], cores=2, mpiexec=MPIEXEC, hang_timeout=bad)
    with pytest.raises(ValueError, match="--hang-timeout"):
        detector_flags(bad)


def test_extra_mpiexec_args_precede_command() -> None:
    argv = build_command(2, ["python", "t.py"], cores=2, mpiexec=MPIEXEC, extra=["--bind-to", "none"])
    assert argv[-4:] == ["--bind-to", "none", "python", "t.py"]


@pytest.mark.parametrize("bad", [0, -1, -8])
def test_bad_n_named(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"-n must be >= 1, got {bad}\b"):
        build_command(bad, ["x"], mpiexec=MPIEXEC)


def test_empty_command() -> None:
    with pytest.raises(ValueError, match="no command given; usage: lightning-recover launch"):
        build_command(2, [], mpiexec=MPIEXEC)


def test_find_mpiexec_is_runnable() -> None:
    path = find_mpiexec()
    assert os.path.isfile(path) and os.access(path, os.X_OK)
    assert build_command(1, ["x"], cores=1)[0] == path


# ------------------------------------------------------------------------------ launch_env
def test_launch_env_root_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    env = launch_env({"PATH": "/bin"})
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    assert env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["PATH"] == "/bin"
    assert env["OMP_NUM_THREADS"] == "1"


def test_launch_env_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    env = launch_env({"PATH": "/bin"})
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in env and "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM" not in env


def test_launch_env_keeps_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    env = launch_env({"OMP_NUM_THREADS": "4", "OMPI_ALLOW_RUN_AS_ROOT": "1"})
    assert env["OMP_NUM_THREADS"] == "4"


def test_launch_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LR_LAUNCH_ENV_PROBE", "yes")
    env = launch_env()
    assert env["LR_LAUNCH_ENV_PROBE"] == "yes"
    assert "LR_LAUNCH_ENV_PROBE" in os.environ, "launch_env must copy, never modify os.environ"
    env["LR_LAUNCH_ENV_PROBE"] = "changed"
    assert os.environ["LR_LAUNCH_ENV_PROBE"] == "yes"


# ------------------------------------------------------------------------------ the CLI
def _cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    try:
        return subprocess.run(
            [sys.executable, "-m", "lightning_recover.cli", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True,
        )
    except subprocess.TimeoutExpired as exc:  # subprocess.run kills the child; say what hung
        raise AssertionError(f"lightning-recover {shlex.join(args)} did not finish in {timeout}s") from exc


@pytest.mark.mpi
def test_launch_runs_two_real_ranks_and_prints_the_command() -> None:
    probe = (
        "from mpi4py import MPI; import os; c = MPI.COMM_WORLD; "
        "print(f'rank {c.Get_rank()} of {c.Get_size()} ft={os.environ.get(\"OMPI_MCA_mpi_ft_enable\")}', flush=True)"
    )
    res = _cli("launch", "-n", "2", "--", sys.executable, "-c", probe)
    assert res.returncode == 0, res.stderr
    assert sorted(line for line in res.stdout.splitlines() if line.startswith("rank ")) == [
        "rank 0 of 2 ft=1",
        "rank 1 of 2 ft=1",
    ]
    printed = [line for line in res.stderr.splitlines() if line.startswith("[lightning-recover] ")]
    assert printed, res.stderr
    argv = shlex.split(printed[0][len("[lightning-recover] "):])
    assert argv[1:8] == ["--with-ft", "ulfm", "--prtemca", "state_base_recoverable", "1", "-n", "2"]
    assert argv[-3:] == [sys.executable, "-c", probe]
    assert "mpi_ft_detector" not in argv  # the ULFM detector only on request (--mpi-detector)


@pytest.mark.mpi
def test_launch_passes_the_exit_status_through() -> None:
    res = _cli("launch", "-n", "1", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert res.returncode != 0


def test_launch_errors_exit_2() -> None:
    res = _cli("launch", "-n", "0", "--", "true")
    assert res.returncode == 2
    assert "-n must be >= 1, got 0" in res.stderr
    res = _cli("launch", "-n", "2")
    assert res.returncode == 2
    assert "no command given" in res.stderr
    res = _cli("launch", "-n", "2", "--hang-timeout", "-1", "--", "true")
    assert res.returncode == 2
    assert "--hang-timeout must be >= 0 seconds, got -1" in res.stderr


def test_launch_requires_n_outside_slurm(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["launch", "--", "true"]) == 2
    assert "give the number of ranks: -n N" in capsys.readouterr().err


def test_launch_inside_an_allocation_takes_its_tasks_hosts_and_runs_unbound(monkeypatch: pytest.MonkeyPatch) -> None:
    # sbatch -n 4 -O on a node with 1 CPU given to the job: what the batch script's environment holds.
    from lightning_recover.cli import hosts, launcher
    from lightning_recover.cli.supervision import Host

    for var, value in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "localhost",
                       "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_CPUS_PER_NODE": "1"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(hosts, "slurm_allocation", lambda: (Host("localhost", 4),))
    calls: list[tuple] = []
    monkeypatch.setattr(launcher, "launch", lambda n, cmd, **kw: calls.append((n, cmd, kw)) or 0)
    assert cli.main(["launch", "--", "python", "t.py"]) == 0
    (n, cmd, kw), = calls
    assert n == 4 and cmd == ["python", "t.py"] and kw["hosts"] == (Host("localhost", 4),) and kw["unbound"] is True
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "4")  # one CPU per task: binding works, keep it
    assert cli.main(["launch", "-n", "2", "--", "python", "t.py"]) == 0
    assert calls[-1][0] == 2 and calls[-1][2]["unbound"] is False


def test_no_command_prints_usage(capsys: pytest.CaptureFixture) -> None:
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "usage: lightning-recover COMMAND" in out
    assert "launch" in out and "check-ledger" in out
    assert "demo" not in out and "chaos" not in out, "the checkout's tools are not commands of the package"


@pytest.mark.parametrize(("command", "script"), [("demo", "examples/demo.py"), ("chaos", "-m benchmarks.chaos")])
def test_moved_commands_name_the_script_that_replaces_them(command: str, script: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main([command, "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err == f"lightning-recover: {command!r} is no longer a command; from a source checkout run: python {script}\n"
    # The script it names exists in the checkout and starts (its --help needs no MPI job).
    res = subprocess.run(
        [sys.executable, *script.split(), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60, start_new_session=True
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: python {script} ")


def test_help_prints_usage(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--help"]) == 0
    assert "usage: lightning-recover COMMAND" in capsys.readouterr().out


def test_unknown_command_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err
    assert "usage: lightning-recover COMMAND" in err


def test_console_script_is_installed() -> None:
    script = os.path.join(os.path.dirname(sys.executable), "lightning-recover")
    script = script if os.path.exists(script) else shutil.which("lightning-recover")
    assert script, "the lightning-recover console script is not installed (pip install -e .)"
    res = subprocess.run([script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    assert "usage: lightning-recover COMMAND" in res.stdout


# ------------------------------------------------------------------------------ the launcher's last words
def _markers(tmp_path: Path, files: dict[str, str]) -> JobMarkers:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return JobMarkers.read(str(tmp_path))


BUG = "ValueError\nValueError: user bug 42\n"


def test_a_job_stopped_for_want_of_quorum_fails_and_says_how_to_go_on(tmp_path: Path) -> None:
    m = _markers(tmp_path, {"started.0": "", "started.1": "", "exited.0": "no quorum: 1 replica ties with 1", "exited.1": "no quorum: x"})
    assert m.no_quorum == {0, 1}
    status, words = final_words(m, 4, 0)
    assert status == 75, "mpiexec says 0; a job that stopped for want of quorum did not finish"
    assert words is not None and words.startswith("ranks 0, 1 stopped for want of a quorum") and "--supervise" in words
    # A world that finished elsewhere is what counts: then the stopped side is only a note-free detail.
    assert final_words(_markers(tmp_path, {"ok.2": "", "ok.3": ""}), 4, 0) == (0, None)


def test_a_side_that_stopped_behind_a_healed_cut_does_not_fail_a_job_that_finished(tmp_path: Path) -> None:
    # A flap: rank 1 was cut off, stopped for want of quorum, and its status 75 reached mpiexec once
    # the link was back; the last world (rank 0) finished every step.
    files = {"started.0": "", "started.1": "", "exited.1": "no quorum: 1 tie", "ok.0": "", "done.0": "0"}
    status, words = final_words(_markers(tmp_path, files), 2, 75)
    assert status == 0
    assert words == "note: rank 1 stopped for want of a quorum while cut off; the last world went on without them and finished"
    # A cut that never healed: mpiexec lost the cut-off host's daemon and says 250 -- the job still finished.
    assert final_words(_markers(tmp_path, files), 2, 250)[0] == 0
    # Without the last world's done marker the job did not finish: mpiexec's status stays.
    (tmp_path / "done.0").unlink()
    assert final_words(JobMarkers.read(str(tmp_path)), 2, 75)[0] == 75


def test_every_rank_raised_the_same_error(tmp_path: Path) -> None:
    m = _markers(tmp_path, {"started.0": "", "started.1": "", "raised.0": BUG, "raised.1": BUG, "printed.0123abcd": ""})
    assert m.raised == {0: ("ValueError", "ValueError: user bug 42"), 1: ("ValueError", "ValueError: user bug 42")}
    status, words = final_words(m, 2, 0)
    assert status == 1, "mpiexec says 0 after SIGKILLed ranks; the job failed"
    assert words == (
        "the program raised ValueError on every rank (ValueError: user bug 42), traceback above; "
        "fix the error, then relaunch (from the newest checkpoint: ckpt_path=last). Exit status 1"
    )


def test_a_refused_setting_is_status_2_and_the_ranks_line_alone(tmp_path: Path) -> None:
    # A ConfigurationError in setup: the ranks printed its one line (runtime/refusal.py) and left by a
    # signal (mpiexec says 0), or the first left with status 2 before MPI was up and mpiexec ended the rest.
    cfg = "ConfigurationError\nConfigurationError: recover.target_replicas=3 but the job has 2 replicas\n"
    for files, mpiexec_status in (({"raised.0": cfg, "raised.1": cfg}, 0), ({"raised.1": cfg}, 2)):
        markers = _markers(tmp_path / str(mpiexec_status), files)
        assert markers.refused
        assert final_words(markers, 2, mpiexec_status) == (2, None)
    assert not _markers(tmp_path / "bug", {"raised.0": BUG}).refused


def test_some_ranks_raised_and_the_others_died(tmp_path: Path) -> None:
    other = "RuntimeError\nRuntimeError: other\n"
    files = {f"started.{r}": "" for r in range(4)} | {"raised.0": BUG, "raised.2": BUG, "raised.3": other}
    status, words = final_words(_markers(tmp_path, files), 4, 137)
    assert status == 137, "mpiexec's own non-zero status stays"
    assert words == (
        "the program raised ValueError on ranks 0, 2 (ValueError: user bug 42) and RuntimeError on rank 3 "
        "(RuntimeError: other), tracebacks above; rank 1 died or left through the replica-consistency gate; "
        "fix the error, then relaunch (from the newest checkpoint: ckpt_path=last). Exit status 137"
    )


def test_replicas_died_without_an_exception(tmp_path: Path) -> None:
    status, words = final_words(_markers(tmp_path, {"started.0": "", "started.1": ""}), 2, 0)
    assert status == 1
    assert words is not None and words.startswith("every rank of the job failed: no replica survived to continue in place: the replicas died")
    assert "no rank raised an exception" in words and "ckpt_path=last" in words and "raised ValueError" not in words


def test_survivors_finished_after_one_rank_raised(tmp_path: Path) -> None:
    files = {f"started.{r}": "" for r in range(4)} | {"raised.3": BUG, "ok.0": "", "ok.1": "", "ok.2": ""}
    status, words = final_words(_markers(tmp_path, files), 4, 0)
    assert status == 0, "the survivors finished: the job succeeded"
    assert words == (
        "note: the program raised ValueError on rank 3 (ValueError: user bug 42), traceback above; "
        "the other replicas went on without those ranks and finished"
    )


@pytest.mark.parametrize("files", [{}, {"started.0": "", "ok.0": ""}, {"started.0": "", "started.1": "", "exited.0": "", "exited.1": ""}])
def test_nothing_to_add_for_a_normal_or_deliberate_end(tmp_path: Path, files: dict[str, str]) -> None:
    assert final_words(_markers(tmp_path, files), 2, 0) == (0, None)
    (tmp_path / "empty").mkdir()
    assert final_words(_markers(tmp_path / "empty", {}), 2, 3) == (3, None)


def test_rank_ranges(tmp_path: Path) -> None:
    files = {f"raised.{r}": BUG for r in range(1, 5)}
    _, words = final_words(_markers(tmp_path, files), 6, 0)
    assert words is not None and words.startswith("the program raised ValueError on ranks 1-4 (ValueError: user bug 42), traceback above; ranks 0, 5 died")


def test_runtime_status_after_a_failed_spawn_is_not_the_jobs(tmp_path: Path) -> None:
    # Hot re-join could not place a replacement: prte exits 213 though every rank ended normally.
    m = _markers(tmp_path, {"started.0": "", "started.1": "", "ok.0": ""})
    status, words = final_words(m, 2, 213)
    assert status == 0 and words is not None and "mpiexec exited with status 213" in words
    # A deliberate non-zero stop (exited marker) keeps mpiexec's status.
    m = _markers(tmp_path, {"exited.1": ""})
    assert final_words(m, 2, 3)[0] == 3


# ------------------------------------------------------------------------------ an mpiexec that outlives the job
def _lingering_mpiexec(tmp_path: Path, done: str, ok: list[int]) -> list[str]:
    """A stand-in for mpiexec after a frozen host: the last world ended, mpiexec waits on forever."""
    touch = " ".join(f"{tmp_path}/ok.{r}" for r in ok)
    return ["sh", "-c", f"touch {touch}; echo {done} > {tmp_path}/done.0; exec sleep 120"]


def test_mpiexec_waiting_on_an_unreachable_host_is_ended_once_the_last_world_finished(tmp_path: Path) -> None:
    import time

    t0 = time.monotonic()
    status = run_supervised(
        _lingering_mpiexec(tmp_path, "0,1", [0, 1]), grace_s=1.0, timeout_s=60,
        finished=lambda: JobMarkers.read(str(tmp_path)).finished,
    )
    assert status == 0 and time.monotonic() - t0 < 30


def test_a_member_of_the_last_world_still_running_keeps_the_job(tmp_path: Path) -> None:
    # Rank 2 is in the last world but has not left: the job is not over, whatever mpiexec does.
    with pytest.raises(subprocess.TimeoutExpired):
        run_supervised(
            _lingering_mpiexec(tmp_path, "0,1,2", [0, 1]), grace_s=0.5, timeout_s=4,
            finished=lambda: JobMarkers.read(str(tmp_path)).finished,
        )
    assert JobMarkers.read(str(tmp_path)).done == {0, 1, 2}
