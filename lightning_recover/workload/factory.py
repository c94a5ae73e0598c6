"""make_policy: the workload policy a run's settings name (``recover.policy``), of ReCoVer's versatile workload.

The strategy, the data feed and the tests build their policy here from its config name
(:data:`lightning_recover.config.POLICY_NAMES`), so that a name the configuration accepts
always maps to the same class and settings on every rank.
"""

from __future__ import annotations

from lightning_recover.config import POLICY_NAMES, ConfigurationError
from lightning_recover.workload.adaptive_world import AdaptiveWorld
from lightning_recover.workload.policy import WorkloadPolicy
from lightning_recover.workload.static_world import StaticWorld

__all__ = ["make_policy"]


def make_policy(
    name: str,
    W_init: int,
    G_init: int,
    T: int | None = None,
    min_replicas: int = 1,
    *,
    join_as_spare: bool = True,
) -> WorkloadPolicy:
    """Build a policy by its config name ("static" or "adaptive"); ``join_as_spare`` is static's only."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key == "static":
        return StaticWorld(W_init, G_init, T=T, min_replicas=min_replicas, join_as_spare=join_as_spare)
    if key == "adaptive":
        if T is not None and T != W_init:
            raise ConfigurationError(
                f"AdaptiveWorld has no spares, so T must equal W_init={W_init}, got T={T}; "
                f"leave recover.target_replicas unset for the adaptive policy"
            )
        return AdaptiveWorld(W_init, G_init, min_replicas=min_replicas)
    raise ConfigurationError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)} (recover.policy)")
