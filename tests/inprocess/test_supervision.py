"""The supervised relaunch's decisions (lightning_recover.cli.supervision): pure, property-tested."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lightning_recover.cli.supervision import (
    LOST_DAEMON,
    RELAUNCHABLE,
    RUNTIME_START_FAILURE,
    TOO_FEW_REPLICAS_STATUS,
    Host,
    Outcome,
    Plan,
    SupervisionPolicy,
    classify,
    decide,
    first_plan,
    host_arg,
    hosts_named_lost,
    parse_host_list,
    parse_hostfile,
    relaunch_plan,
    slurm_hosts,
)
from lightning_recover.runtime.slurm import parse_slurm_counts


def lost_daemon_text(node: str) -> str:
    """PRRTE 3.0's [node-died] message as printed (help-errmgr-base.txt)."""
    return (
        "--------------------------------------------------------------------------\n"
        f"{LOST_DAEMON}.\n\n  HNP daemon   : [prterun-nodeA-4242@0,0] on node nodeA\n"
        f"  Remote daemon: [prterun-nodeA-4242@0,2] on node {node}\n\n"
        "This is usually due to either a failure of the TCP network\n"
    )


def daemon_report_text(node: str) -> str:
    """prterun's report of a daemon that never came up (seen here for an unresolvable host)."""
    return (
        "------------------------------------------------------------\n"
        "A daemon failed to report back after being spawned. This could\nbe due to several factors, including ...\n\n"
        f"  Local host:    vm\n  Remote host:   {node}\n  Daemon exit status: 255\n"
    )


# ------------------------------------------------------------------------------ hosts
def test_host_list_and_hostfile_parse() -> None:
    assert parse_host_list("a:2,b:3,c") == (Host("a", 2), Host("b", 3), Host("c", 1))
    text = "# cluster\nnodeA slots=4\nnodeB slots=2 max_slots=8  # fast\n\nnodeC\n"
    assert parse_hostfile(text) == (Host("nodeA", 4), Host("nodeB", 2), Host("nodeC", 1))
    assert host_arg(parse_host_list("a:2,b:3")) == "a:2,b:3"


@pytest.mark.parametrize(
    ("spec", "needle"),
    [("a:2,,b:2", "empty entry"), ("a:x", "slots 'x' is not a number"), ("a:0", "slots=0"), ("a:2,a:2", "twice"), ("a b:2", "not a host name")],
)
def test_bad_host_lists_name_the_value_and_the_fix(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        parse_host_list(spec)
    assert "node" in str(info.value) or "'a" in str(info.value)


def test_bad_hostfile_names_the_line() -> None:
    with pytest.raises(ValueError, match=r"hf:2: 'cpus=4' is not 'slots=N'"):
        parse_hostfile("a slots=1\nb cpus=4\n", "hf")
    with pytest.raises(ValueError, match="names no host"):
        parse_hostfile("# nothing\n")


def test_slurm_counts() -> None:
    assert parse_slurm_counts("4(x2),2", 3) == [4, 4, 2]
    assert slurm_hosts(["n1", "n2"], "2(x2)") == (Host("n1", 2), Host("n2", 2))
    with pytest.raises(ValueError, match="gives 2 node"):
        parse_slurm_counts("2(x2)", 3)
    with pytest.raises(ValueError, match="is not like"):
        parse_slurm_counts("2x2", 1)


def test_lost_daemon_message_names_the_host() -> None:
    hosts = parse_host_list("nodeA:2,nodeB:2,nodeC:2")
    assert hosts_named_lost(lost_daemon_text("nodeB"), hosts) == {"nodeB"}
    # PRRTE prints short names; a host given as an FQDN still matches.
    assert hosts_named_lost(lost_daemon_text("nodeB"), parse_host_list("nodeA.x.org:2,nodeB.x.org:2")) == {"nodeB.x.org"}
    # A daemon that never reported back at start-up: its host is named too.
    assert hosts_named_lost(daemon_report_text("nodeC"), hosts) == {"nodeC"}
    assert classify(Outcome(2, 255, daemon_report_text("nodeC"))) == "runtime_start_failed"
    # Without those headlines nothing is taken as lost, whatever else is printed.
    assert hosts_named_lost("Remote daemon: [x@0,2] on node nodeB", hosts) == frozenset()


# ------------------------------------------------------------------------------ classification
def test_classify_judges_by_the_markers_not_mpiexecs_status() -> None:
    assert classify(Outcome(2, 0, ok=frozenset({0}))) == "completed"
    # mpiexec says 0 after PRRTE's abort: the markers say nobody finished.
    assert classify(Outcome(2, 0, lost_daemon_text("b"), started=frozenset({0, 1}))) == "lost_daemon"
    assert classify(Outcome(2, 0, started=frozenset({0, 1}))) == "died"
    assert classify(Outcome(2, 0, started=frozenset({0, 1}), stalled=True)) == "stalled"
    assert classify(Outcome(2, 1, started=frozenset({0, 1}), raised={0: "ValueError: x"})) == "raised"
    # Ranks of a job PRRTE aborts may raise on the way down: the lost daemon is the cause.
    assert classify(Outcome(2, 0, lost_daemon_text("b"), raised={0: "MPI.Exception: x"})) == "lost_daemon"
    assert classify(Outcome(2, TOO_FEW_REPLICAS_STATUS, started=frozenset({0}), exited=frozenset({0}))) == "too_few_replicas"
    assert classify(Outcome(2, 2, started=frozenset({0}), exited=frozenset({0}))) == "stopped"
    # A side stopped by the quorum rule (the job reports 75): relaunch, even if a mate raised on its way out.
    quorum = Outcome(2, 75, started=frozenset({0, 1}), exited=frozenset({0}), no_quorum=frozenset({0}), raised={1: "x"})
    assert classify(quorum) == "no_quorum"
    assert classify(Outcome(2, 1, RUNTIME_START_FAILURE)) == "runtime_start_failed"
    assert classify(Outcome(2, 127, "python: can't open file")) == "not_started"


# ------------------------------------------------------------------------------ examples
POLICY = SupervisionPolicy(max_relaunches=2, replica_size=2, min_replicas=1, backoff_s=1.0, max_backoff_s=3.0)
HOSTS = parse_host_list("a:2,b:2,c:2")


def test_lost_daemon_relaunches_on_the_rest_with_whole_replicas() -> None:
    plan = first_plan(POLICY, HOSTS, 6)
    d = decide(POLICY, plan, Outcome(6, 0, lost_daemon_text("b"), started=frozenset(range(6))), relaunches_done=0, target_nprocs=6)
    assert d.action == "relaunch" and d.lost == {"b"} and d.backoff_s == 1.0
    assert d.plan == Plan((Host("a", 2), Host("c", 2)), 4)
    assert "lost host(s): b" in d.reason


def test_probe_adds_unnamed_lost_hosts_and_a_spent_budget_gives_up() -> None:
    plan = first_plan(POLICY, HOSTS, 6)
    died = Outcome(6, 0, started=frozenset(range(6)))
    d = decide(POLICY, plan, died, relaunches_done=1, target_nprocs=6, unreachable=frozenset({"c"}))
    assert d.action == "relaunch" and d.plan is not None and [h.name for h in d.plan.hosts] == ["a", "b"] and d.backoff_s == 2.0
    spent = decide(POLICY, plan, died, relaunches_done=2, target_nprocs=6)
    assert spent.action == "give_up" and "all 2 relaunch(es) are spent" in spent.reason and "--max-relaunches" in spent.reason


def test_too_few_slots_gives_up_naming_the_fixes() -> None:
    policy = SupervisionPolicy(replica_size=2, min_replicas=2)
    plan = first_plan(policy, parse_host_list("a:2,b:3"), 4)
    d = decide(policy, plan, Outcome(4, 0, lost_daemon_text("a")), relaunches_done=0, target_nprocs=4)
    assert d.action == "give_up"
    assert "room for 1 replica(s) of 2 rank(s), fewer than --min-replicas 2" in d.reason
    assert "--oversubscribe" in d.reason and "--hosts" in d.reason


def test_program_errors_are_not_relaunched() -> None:
    plan = first_plan(POLICY, HOSTS, 6)
    raised = decide(POLICY, plan, Outcome(6, 1, started=frozenset({0}), raised={0: "ValueError: bad lr"}), relaunches_done=0, target_nprocs=6)
    assert raised.action == "give_up" and "ValueError: bad lr" in raised.reason and "fix the error" in raised.reason
    config = decide(POLICY, plan, Outcome(6, 2, started=frozenset({0}), exited=frozenset({0})), relaunches_done=0, target_nprocs=6)
    assert config.action == "give_up" and "exit status 2" in config.reason


def test_first_plan_refusals() -> None:
    with pytest.raises(ValueError, match="-n 3 is not a positive multiple of the replica size 2"):
        first_plan(POLICY, HOSTS, 3)
    with pytest.raises(ValueError, match=r"needs more slots than the hosts have \(a:2: 2\).*--oversubscribe"):
        first_plan(SupervisionPolicy(), parse_host_list("a:2"), 4)
    assert first_plan(SupervisionPolicy(oversubscribe=True), parse_host_list("a:2"), 4).nprocs == 4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"max_relaunches": -1}, "--max-relaunches"), ({"replica_size": 0}, "--replica-size"), ({"min_replicas": 0}, "--min-replicas"),
     ({"backoff_s": -1.0}, "--relaunch-backoff"), ({"backoff_s": 5.0, "max_backoff_s": 1.0}, "--relaunch-backoff")],
)
def test_bad_policy_named(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SupervisionPolicy(**kwargs)


# ------------------------------------------------------------------------------ properties
names = st.sampled_from([f"n{i}" for i in range(8)])
host_lists = st.lists(st.tuples(names, st.integers(1, 6)), min_size=1, max_size=8, unique_by=lambda t: t[0]).map(
    lambda items: tuple(Host(n, s) for n, s in items)
)
policies = st.builds(
    SupervisionPolicy,
    max_relaunches=st.integers(0, 5),
    replica_size=st.integers(1, 4),
    min_replicas=st.integers(1, 3),
    oversubscribe=st.booleans(),
    backoff_s=st.floats(0, 10),
    max_backoff_s=st.just(10.0),
)


@st.composite
def outcomes(draw: st.DrawFn, hosts: tuple[Host, ...], nprocs: int) -> Outcome:
    ranks = st.frozensets(st.integers(0, nprocs - 1))
    tail = draw(st.sampled_from(["", RUNTIME_START_FAILURE, "noise"] + [lost_daemon_text(h.name) for h in hosts]
                               + [daemon_report_text(h.name) for h in hosts] + [lost_daemon_text("elsewhere")]))
    return Outcome(
        nprocs,
        draw(st.sampled_from([0, 1, 2, TOO_FEW_REPLICAS_STATUS, 70, 137])),
        tail,
        started=draw(ranks),
        ok=draw(st.frozensets(st.integers(0, nprocs - 1), max_size=1 if draw(st.booleans()) else 0)),
        exited=draw(ranks),
        raised=draw(st.dictionaries(st.integers(0, nprocs - 1), st.sampled_from(["ValueError: x", "RuntimeError: y"]), max_size=2)),
        stalled=draw(st.booleans()),
    )


@settings(max_examples=400, deadline=None)
@given(data=st.data(), policy=policies, hosts=host_lists)
def test_supervision_never_breaks_its_bounds(data: st.DataObject, policy: SupervisionPolicy, hosts: tuple[Host, ...]) -> None:
    """Run a whole supervision on drawn outcomes: every invariant of the relaunch loop holds at every step."""
    S = policy.replica_size
    slots = sum(h.slots for h in hosts)
    replicas = data.draw(st.integers(policy.min_replicas, max(policy.min_replicas, (slots if not policy.oversubscribe else 2 * slots) // S)))
    nprocs = replicas * S
    assume(policy.oversubscribe or nprocs <= slots)
    plan = first_plan(policy, hosts, nprocs)
    lost_ever: set[str] = set()
    relaunches = 0
    for _ in range(policy.max_relaunches + 2):
        outcome = data.draw(outcomes(plan.hosts, plan.nprocs))
        unreachable = data.draw(st.frozensets(st.sampled_from([h.name for h in hosts])))
        d = decide(policy, plan, outcome, relaunches_done=relaunches, target_nprocs=nprocs, unreachable=unreachable)
        assert d.reason
        if outcome.ok:
            assert d.action == "done", "a rank that ended normally means the job finished"
        if d.action != "relaunch":
            assert d.plan is None
            if d.action == "give_up" and classify(outcome) in RELAUNCHABLE and relaunches < policy.max_relaunches:
                # The only other reason to stop: not enough room for min_replicas on the remaining hosts.
                assert "fewer than --min-replicas" in d.reason
            break
        assert classify(outcome) in RELAUNCHABLE
        assert relaunches < policy.max_relaunches, "never relaunch beyond the budget"
        assert d.plan is not None
        # The lost hosts of this run: those PRRTE named and those the probe did not reach.
        assert d.lost == (hosts_named_lost(outcome.output_tail, plan.hosts) | unreachable) & {h.name for h in plan.hosts}
        lost_ever |= d.lost
        new = d.plan
        assert not {h.name for h in new.hosts} & lost_ever, "never schedule onto a lost host"
        assert {h.name for h in new.hosts} <= {h.name for h in plan.hosts}, "hosts only ever go away"
        assert new.nprocs % S == 0 and new.nprocs // S >= policy.min_replicas, "whole replicas, at least min_replicas"
        assert new.nprocs <= nprocs, "never more ranks than the original job"
        assert policy.oversubscribe or new.nprocs <= new.slots, "never more ranks than slots unless oversubscription is allowed"
        assert 0 <= d.backoff_s <= policy.max_backoff_s
        assert d.backoff_s == policy.backoff(relaunches + 1)
        relaunches += 1
        plan = new
    else:
        pytest.fail("the loop never ended")
    assert relaunches <= policy.max_relaunches


@given(policy=policies, hosts=host_lists, target=st.integers(1, 40))
def test_relaunch_plan_takes_as_many_whole_replicas_as_fit(policy: SupervisionPolicy, hosts: tuple[Host, ...], target: int) -> None:
    S = policy.replica_size
    target *= S
    plan = relaunch_plan(policy, hosts, target)
    slots = sum(h.slots for h in hosts)
    fit = target if policy.oversubscribe else min(target, S * (slots // S))
    if fit // S >= policy.min_replicas:
        assert isinstance(plan, Plan) and plan.nprocs == fit and plan.hosts == hosts
    else:
        assert isinstance(plan, str) and f"fewer than --min-replicas {policy.min_replicas}" in plan


@given(policy=policies, k=st.integers(1, 100))
def test_backoff_grows_and_stays_bounded(policy: SupervisionPolicy, k: int) -> None:
    assert policy.backoff(k) <= policy.backoff(k + 1) <= policy.max_backoff_s


@given(hosts=host_lists)
def test_host_list_round_trips(hosts: tuple[Host, ...]) -> None:
    assert parse_host_list(host_arg(hosts)) == hosts
    assert parse_hostfile("\n".join(f"{h.name} slots={h.slots}" for h in hosts)) == hosts


# ------------------------------------------------------------------------------ the launcher's side
def test_resume_command_replaces_the_users_value_of_the_key() -> None:
    from lightning_recover.cli.launcher import DEFAULT_RESUME_ARG, resume_command

    cmd = ["python", "pretrain.py", "ckpt_path=/old/step-3.ckpt", "seed=1", "+x=ckpt_path=1"]
    assert resume_command(cmd, DEFAULT_RESUME_ARG) == ["python", "pretrain.py", "seed=1", "+x=ckpt_path=1", "++ckpt_path=last"]
    assert resume_command(["python", "t.py", "--resume"], "--resume") == ["python", "t.py", "--resume", "--resume"]


def test_build_command_places_the_job_on_the_hosts() -> None:
    from lightning_recover.cli.mpiexec import build_command

    argv = build_command(4, ["x"], mpiexec="mpiexec", hosts="a:2,b:2", slots=4, cores=1)
    assert argv[argv.index("--host") + 1] == "a:2,b:2" and "--oversubscribe" not in argv, "slots, not this machine's cores"
    assert "--oversubscribe" in build_command(5, ["x"], mpiexec="mpiexec", hosts="a:2,b:2", slots=4)
    assert "--oversubscribe" in build_command(2, ["x"], mpiexec="mpiexec", hosts="a:2", slots=2, oversubscribe=True)


def test_remote_agent_is_mpiexecs() -> None:
    from lightning_recover.cli.hosts import remote_agent

    assert remote_agent(["--prtemca", "plm_ssh_agent", "/h/agent.sh -q", "--bind-to", "none"]) == ["/h/agent.sh", "-q"]
    assert remote_agent(["--bind-to", "none"])[0] == "ssh"


def test_probe_never_probes_this_machine_and_reports_a_silent_host(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from lightning_recover.cli.hosts import probe_unreachable

    agent = tmp_path / "agent.sh"
    agent.write_text('#!/bin/sh\n[ "$1" = up ] && exit 0\n[ "$1" = slow ] && sleep 30\nexit 255\n')
    agent.chmod(0o755)
    hosts = parse_host_list("localhost:2,up:2,down:2,slow:2")
    assert probe_unreachable(hosts, ["--prtemca", "plm_ssh_agent", str(agent)], timeout_s=1.0) == {"down", "slow"}


def test_slurm_allocation_from_scontrol(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from lightning_recover.cli.hosts import slurm_allocation

    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames n[1-3]" ] && printf "n1\\nn2\\nn3\\n" && exit 0\nexit 1\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert slurm_allocation(env) == (Host("n1", 2), Host("n2", 2), Host("n3", 1))
    assert slurm_allocation({}) is None
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        slurm_allocation({"SLURM_JOB_NODELIST": "n[1-3]"})
    with pytest.raises(ValueError, match="give --hosts explicitly"):
        slurm_allocation({"SLURM_JOB_NODELIST": "m[1-3]", "SLURM_TASKS_PER_NODE": "1"})


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--supervise"], "--supervise needs --checkpoint-dir"),
     (["--supervise", "--checkpoint-dir", "d", "--stall-timeout", "5"], "--stall-timeout 5.0 needs --ledger"),
     (["--supervise", "--checkpoint-dir", "d", "--max-relaunches", "-1"], "--max-relaunches must be an integer >= 0"),
     (["--supervise", "--checkpoint-dir", "d", "--hosts", "a:x"], "slots 'x' is not a number"),
     (["--supervise", "--checkpoint-dir", "d", "--hosts", "a:1"], "needs more slots than the hosts have"),
     (["--supervise", "--checkpoint-dir", "d", "--hostfile", "/no/such/file"], "--hostfile '/no/such/file' cannot be read"),
     (["--supervise", "--checkpoint-dir", "d", "--replica-size", "2"], "-n 3 is not a positive multiple of the replica size 2")],
)
def test_supervise_usage_errors_exit_2_naming_the_fix(args: list[str], needle: str, capsys: pytest.CaptureFixture) -> None:
    from lightning_recover.cli import commands as cli

    n = "3" if "--replica-size" in args else "2"
    assert cli.main(["launch", "-n", n, *args, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("lightning-recover launch: "), err


def test_a_failed_attempt_whose_last_world_was_finishing_is_read_once_it_finished(tmp_path: Path) -> None:
    """mpiexec ended the job (a lost host's daemon) while the survivors were leaving after their last
    step: the supervisor waits for their ok markers instead of relaunching a finished job."""
    import threading

    from lightning_recover.cli.launcher import settled_markers

    (tmp_path / "done.1").write_text("1,2")
    (tmp_path / "ok.1").write_text("")
    later = threading.Timer(0.3, lambda: (tmp_path / "ok.2").write_text(""))
    later.start()
    markers = settled_markers(str(tmp_path), status=1, grace_s=30)
    later.join()
    assert markers.finished and markers.ok == {1, 2}


def test_without_a_done_marker_or_after_success_nothing_is_waited_for(tmp_path: Path) -> None:
    import time

    from lightning_recover.cli.launcher import settled_markers

    (tmp_path / "started.1").write_text("")
    start = time.monotonic()
    assert not settled_markers(str(tmp_path), status=1, grace_s=30).finished  # no done: a killed world
    (tmp_path / "done.1").write_text("1,2")
    assert not settled_markers(str(tmp_path), status=0, grace_s=30).finished  # mpiexec's success is its own verdict
    assert time.monotonic() - start < 10  # neither waited out its 30 s grace
