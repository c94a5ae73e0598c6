"""The control plane's cost at n ranks, up to 10^5: what the step and a repair ask of ULFM, extrapolated.

A model, for ``benchmarks/simulate.py`` and docs/benchmarks.md ("The control plane at
scale"). Two halves, kept apart:

* **What the protocol asks** -- measured, not modelled: ``benchmarks/control_plane.py``
  counts every MPI call of the real step engine over ULFM at 4-64 ranks
  (``mpi_counter.py``). A steady step makes the same calls with the same payload on
  every rank at every size: one ``Iallreduce`` per gradient bucket (shard communicator),
  one for the step's 40-byte header (world), one ``Iagree`` (4 bytes). A repair makes
  ``Revoke`` x2, ``Shrink``, one ``Split`` (the shard communicators; the world is the shrunk
  communicator itself when every surviving replica is whole) and one ``Agree``; its only
  payload growing with n is the (color, key) all-gather that ``MPI_Comm_split`` implies
  (8 bytes per member). :func:`steady_step_bytes`, :func:`steady_step_calls` and
  :func:`repair_bytes` restate those counts.

* **What ULFM takes to do it at n ranks** -- the published algorithms' growth, with one
  stated constant, the latency of one message hop (:data:`HOP_S`):

  - ``MPIX_Comm_agree`` is Open MPI's Early Returning Agreement (ERA): Herault,
    Bouteiller, Bosilca, Gamell, Teranishi, Parashar, Dongarra, "Practical Scalable
    Consensus for Pseudo-Synchronous Distributed Systems", SC15 (ACM, Austin 2015). Failure
    free it exchanges a logarithmic number of messages over a tree (a reduction up, the
    decision down) and the paper shows the measured cost following that logarithm in
    synthetic benchmarks and two applications; since ULFM 1.0 it has no single point of
    failure (fault-tolerance.org, "Logarithmic Agreement Routine" and "ULFM 1.0 Announced",
    2015-08-27, which also credit it for the speed-up of ``MPI_COMM_SHRINK``).
  - ``MPIX_Comm_revoke`` is a reliable broadcast over a binomial graph of logarithmic
    degree: Bouteiller, Bosilca, Dongarra, "Plan B: Interruption of Ongoing MPI Operations
    to Support Failure Recovery", EuroMPI 2015, measured on **6,000 processes** (Cray), where
    a revoked Barrier's latency is independent of the initiator and "similar to the cost
    of a small message Broadcast".
  - Failure detection and its propagation: Bosilca, Bouteiller, Guermouche, Herault,
    Robert, Sens, Dongarra, "Failure Detection and Propagation in HPC systems", SC16
    (journal version IJHPCA 32(1):139-158, 2018): an observation ring (each node watched by
    one other) and a reliable broadcast over a circulant graph, logarithmic propagation,
    simulated and measured on ORNL's **Titan**. Open MPI's PRRTE detector declares a silent
    node dead after its heartbeat timeout (Open MPI docs, "User-Level Fault Mitigation":
    default period 5 s, timeout 10 s; values near 100 ms usable where faults are common).

  So every ULFM step costs ``rounds * log2(n) * HOP_S`` here, the form those papers measured
  (to 6,000 processes) extrapolated to 10^5. The absolute scale rests on :data:`HOP_S`,
  which the papers' text does not give in a form this model could quote: it is set to
  5 microseconds, a small-message latency of the class the ULFM authors' InfiniBand test
  bed shows (their "quick glance at performance" slides plot IMB ping-pong latency on a
  4-8 microsecond axis); every time here scales linearly with it. What is *not* modelled:
  the gradient buckets' transfer time (the data plane), and the replay of a lost replica's
  microbatches (compute, the policy's business).

The public functions (seconds per rank, bytes per rank; ``n`` ranks, ``failed`` processes
lost at once):

``agree_seconds(n, failed=0)``, ``revoke_seconds(n)``, ``shrink_seconds(n, failed)``,
``split_seconds(n)``, ``detect_seconds(n, node_lost=False, timeout_s=10.0)``,
``repair_seconds(n, failed)``, ``fault_pause_seconds(n, failed, node_lost=False)``,
``steady_step_seconds(n)``, ``steady_step_calls(buckets=1)``,
``steady_step_bytes(n, grad_bytes=0)``, ``steady_step_wire_bytes(n, grad_bytes=0)``,
``repair_bytes(n)``; :data:`SOURCES` names the inputs. ``python
benchmarks/control_plane_model.py`` prints them from 64 to 131,072 ranks.
"""

from __future__ import annotations

import math
import sys

__all__ = [
    "DETECT_LOCAL_S",
    "GROUP_ENTRY_S",
    "HEADER_BYTES",
    "HOP_S",
    "SOURCES",
    "agree_seconds",
    "detect_seconds",
    "fault_pause_seconds",
    "repair_bytes",
    "repair_seconds",
    "revoke_seconds",
    "shrink_seconds",
    "split_seconds",
    "steady_step_bytes",
    "steady_step_calls",
    "steady_step_seconds",
    "steady_step_wire_bytes",
]

#: One small message's hop between two nodes (seconds); see the module docstring.
HOP_S = 5e-6
#: A process death the local daemon reports (SIGKILL, segfault) reaches a peer's MPI in this
#: long, measured on this machine (docs: "A SIGKILLed rank surfaces in ~0.01-0.07 s").
DETECT_LOCAL_S = 0.03
#: Building a communicator's group and translating ranks, per member: a few array
#: operations on an int per rank; 20 ns is an allowance, not a measurement.
GROUP_ENTRY_S = 20e-9
#: The step header the engine reduces over the world every step (loss, counts, votes): 5 fp64.
HEADER_BYTES = 40
#: The agreement's flag (an int).
AGREE_BYTES = 4

SOURCES: dict[str, str] = {
    "agreement": "Herault et al., Practical Scalable Consensus for Pseudo-Synchronous Distributed Systems (ERA), SC15: "
                 "logarithmic failure-free message count, measured to follow log n; ULFM 1.0 notes, fault-tolerance.org 2015-08-27",
    "revoke": "Bouteiller, Bosilca, Dongarra, Plan B: Interruption of Ongoing MPI Operations to Support Failure Recovery, "
              "EuroMPI 2015: reliable broadcast of logarithmic degree, measured on 6,000 processes",
    "detection": "Bosilca et al., Failure Detection and Propagation in HPC systems, SC16 / IJHPCA 32(1) 2018: observation ring, "
                 "logarithmic propagation, ORNL Titan; Open MPI ULFM docs: PRRTE heartbeat timeout 10 s by default",
    "hop": f"one small-message hop = {HOP_S * 1e6:g} us (InfiniBand class; an input of this model, scale every time with it)",
    "calls_and_bytes": "benchmarks/control_plane.py: the real step engine over ULFM, every MPI call counted at 4-64 ranks",
}


def _log2(n: int) -> int:
    """Tree depth of n ranks (0 for one rank)."""
    if n < 1:
        raise ValueError(f"n must be a positive number of ranks, got {n}")
    return math.ceil(math.log2(n)) if n > 1 else 0


def agree_seconds(n: int, failed: int = 0, hop_s: float = HOP_S) -> float:
    """``MPIX_Comm_agree`` over n ranks (ERA, SC15): up and down a tree; each newly failed
    process costs about one more pass (its subtree is re-attached), an upper-bound reading."""
    return 2 * _log2(n) * hop_s * (1 + max(0, failed))


def revoke_seconds(n: int, hop_s: float = HOP_S) -> float:
    """``MPIX_Comm_revoke``: a reliable broadcast over a binomial graph (Plan B, EuroMPI 2015)."""
    return _log2(n) * hop_s


def shrink_seconds(n: int, failed: int, hop_s: float = HOP_S) -> float:
    """``MPIX_Comm_shrink``: an agreement on the failed group, one more agreement-class round
    for the new communicator's id, and the new group built locally (O(n) per rank)."""
    return agree_seconds(n, failed, hop_s) + agree_seconds(n, 0, hop_s) + n * GROUP_ENTRY_S


def split_seconds(n: int, hop_s: float = HOP_S) -> float:
    """``MPI_Comm_split``: an all-gather of (color, key) (log n rounds, 8n bytes in) and a local sort."""
    return _log2(n) * hop_s + n * max(1, _log2(n)) * 5e-9


def detect_seconds(n: int, node_lost: bool = False, timeout_s: float = 10.0, hop_s: float = HOP_S) -> float:
    """Death -> every survivor knows: the local daemon's report (a process) or the heartbeat
    timeout (a node), then a logarithmic propagation (SC16)."""
    return (timeout_s if node_lost else DETECT_LOCAL_S) + _log2(n) * hop_s


def repair_seconds(n: int, failed: int = 1, hop_s: float = HOP_S) -> float:
    """``FaultTolerantComm.repair()``: revoke, shrink, the shard split, one agreement on the new world."""
    survivors = max(1, n - failed)
    return (revoke_seconds(n, hop_s) + shrink_seconds(n, failed, hop_s) + split_seconds(survivors, hop_s)
            + agree_seconds(survivors, 0, hop_s))


def fault_pause_seconds(n: int, failed: int = 1, node_lost: bool = False, timeout_s: float = 10.0, hop_s: float = HOP_S) -> float:
    """The control plane's share of a faulty step: detection, the failed round's agreement,
    the repair, the commit agreement (the re-reduction and the replay are not included)."""
    survivors = max(1, n - failed)
    return (detect_seconds(n, node_lost, timeout_s, hop_s) + agree_seconds(n, failed, hop_s) + repair_seconds(n, failed, hop_s)
            + agree_seconds(survivors, 0, hop_s))


def steady_step_seconds(n: int, hop_s: float = HOP_S) -> float:
    """Latency the control plane adds to a steady step: the header's small all-reduce
    (recursive doubling: log n rounds) and the commit agreement."""
    return _log2(n) * hop_s + agree_seconds(n, 0, hop_s)


def steady_step_calls(buckets: int = 1) -> int:
    """MPI calls per rank per steady step (measured constant in n): the buckets, the header, the agreement."""
    return buckets + 2


def steady_step_bytes(n: int, grad_bytes: int = 0) -> int:
    """Payload bytes a rank hands MPI per steady step (measured constant in n): its gradient
    buckets, the 40-byte header, the agreement's int. ``n`` is accepted for symmetry only."""
    _log2(n)
    return grad_bytes + HEADER_BYTES + AGREE_BYTES


def steady_step_wire_bytes(n: int, grad_bytes: int = 0) -> float:
    """Bytes a rank sends per steady step as the usual algorithms move them: a
    bandwidth-optimal all-reduce of the gradients (2 g (n-1)/n, bounded by 2 g), the header
    by recursive doubling (log n messages), the agreement over a tree (a few small messages)."""
    return 2 * grad_bytes * (n - 1) / n + HEADER_BYTES * _log2(n) + 3 * 8


def repair_bytes(n: int) -> int:
    """Payload bytes per rank of one ``repair()`` on n members: the shard split's (color, key)
    all-gather over the shrunk world (8 bytes per member), the agreement's int."""
    return 8 * n + AGREE_BYTES


def main(argv: list[str] | None = None) -> int:
    sizes = [64, 1024, 8192, 32768, 100_000, 131_072]
    print("control-plane model (hop = %g us; sources in benchmarks/control_plane_model.py)" % (HOP_S * 1e6))
    print(f"{'ranks':>8} | {'agree':>8} | {'revoke':>8} | {'shrink':>9} | {'repair':>9} | "
          f"{'fault pause':>11} | {'node lost':>9} | {'steady':>8} | {'repair B/rank':>13}")
    for n in sizes:
        print(f"{n:>8} | {agree_seconds(n) * 1e6:>6.0f}us | {revoke_seconds(n) * 1e6:>6.0f}us | "
              f"{shrink_seconds(n, 1) * 1e3:>7.2f}ms | {repair_seconds(n) * 1e3:>7.2f}ms | {fault_pause_seconds(n) * 1e3:>9.1f}ms | "
              f"{fault_pause_seconds(n, node_lost=True):>8.2f}s | {steady_step_seconds(n) * 1e6:>6.0f}us | {repair_bytes(n):>13,}")
    lo, hi = 64, 100_000
    print(f"at {hi:,} ranks: steady step +{steady_step_seconds(hi) * 1e6:.0f} us of control plane "
          f"({steady_step_seconds(hi) / steady_step_seconds(lo):.2f}x its {lo}-rank cost), a process loss "
          f"{fault_pause_seconds(hi) * 1e3:.0f} ms ({fault_pause_seconds(hi) / fault_pause_seconds(lo):.2f}x), a node loss "
          f"{fault_pause_seconds(hi, node_lost=True):.1f} s (the 10 s heartbeat timeout)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
