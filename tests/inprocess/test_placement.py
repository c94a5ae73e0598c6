"""The re-join placement rule: the launcher's free hosts and the spawn key each attempt gets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lightning_recover.cli.launcher import _with_spare_hosts
from lightning_recover.cli.supervision import Host, free_hosts
from lightning_recover.membership.placement import SpawnPlacement, spawn_placement
from lightning_recover.runtime.markers import ENV_SPARE_HOSTS


def test_spare_hosts_come_before_partly_used_ones() -> None:
    hosts = [Host("a", 2), Host("b", 2), Host("c", 1), Host("d", 2)]
    assert free_hosts(hosts, 3) == (Host("c", 1), Host("d", 2), Host("b", 1))
    assert free_hosts(hosts, 7) == ()
    assert free_hosts(hosts, 9) == ()


@given(st.lists(st.integers(1, 8), min_size=1, max_size=8), st.integers(0, 70))
def test_free_slots_are_what_the_ranks_leave(slots: list[int], nprocs: int) -> None:
    hosts = [Host(f"h{i}", n) for i, n in enumerate(slots)]
    free = free_hosts(hosts, nprocs)
    assert sum(h.slots for h in free) == max(0, sum(slots) - nprocs)
    total = {h.name: h.slots for h in hosts}
    partly = [i for i, h in enumerate(free) if h.slots < total[h.name]]
    assert len({h.name for h in free}) == len(free)
    # Filling hosts in order leaves at most one host partly used, and it comes after the spare ones.
    assert partly in ([], [len(free) - 1])


def test_each_failed_attempt_starts_at_the_next_host() -> None:
    spare = "c:1,d:2,b:1"
    assert spawn_placement(None, spare, 0) == SpawnPlacement("c:1,d:2,b:1", oversubscribe=True)
    assert spawn_placement(None, spare, 1).host == "d:2,b:1,c:1"
    assert spawn_placement(None, spare, 3).host == "c:1,d:2,b:1"


def test_the_users_hosts_win_and_one_machine_oversubscribes() -> None:
    assert spawn_placement("n7,n8", "c:1", 2) == SpawnPlacement("n7,n8", oversubscribe=False)
    assert spawn_placement(None, None, 0) == SpawnPlacement(None, oversubscribe=True)
    assert spawn_placement(None, "", 1) == SpawnPlacement(None, oversubscribe=True)


def test_the_launcher_exports_free_hosts_only_when_it_places_the_job() -> None:
    hosts = [Host("a", 2), Host("b", 2), Host("c", 2)]
    assert _with_spare_hosts({}, hosts, 3)[ENV_SPARE_HOSTS] == "c:2,b:1"
    assert ENV_SPARE_HOSTS not in _with_spare_hosts({}, hosts, 6)
    assert ENV_SPARE_HOSTS not in _with_spare_hosts({}, None, 2)
    assert _with_spare_hosts({ENV_SPARE_HOSTS: "z:1"}, hosts, 3)[ENV_SPARE_HOSTS] == "z:1"


def test_the_leader_says_where_a_replacement_goes() -> None:
    assert spawn_placement(None, "c:1", 0).describe() == "on c:1"
    assert spawn_placement(None, None, 0).describe() == "on the launch's hosts (oversubscribed)"


def test_a_placement_is_the_spawns_info_keys() -> None:
    assert SpawnPlacement("n7,n8", oversubscribe=False).info_items("/job") == [("wdir", "/job"), ("bind_to", "none"), ("host", "n7,n8")]
    assert SpawnPlacement(None, oversubscribe=True).info_items("/job") == [
        ("wdir", "/job"), ("bind_to", "none"), ("map_by", ":OVERSUBSCRIBE")]
