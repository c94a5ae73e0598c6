"""The one configuration object (lightning_recover.config): every rule, its message, and properties."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_recover.config import (
    POLICY_NAMES, SHORT_FORMS, CheckpointConfig, ConfigurationError, RecoverConfig, RecoverSettings, RejoinConfig, SDCConfig,
    fold_short_forms,
)


def refused(**kwargs: Any) -> str:
    """The one-line message RecoverConfig(**kwargs) is refused with."""
    with pytest.raises(ConfigurationError) as info:
        RecoverConfig(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------- field rules
@pytest.mark.parametrize(
    ("field", "value", "needles"),
    [
        ("shards", 0, ["shards must be a positive integer, got 0", "recover.shards=0", "set recover.shards to the ranks per replica"]),
        ("shards", 2.0, ["shards must be an integer, got 2.0", "set recover.shards"]),
        ("shards", "2", ["shards must be an integer, got '2'"]),
        ("grad_accum", 0, ["grad_accum must be >= 1, got 0", "recover.grad_accum=0", "set recover.grad_accum to a positive integer"]),
        ("grad_accum", True, ["grad_accum must be an integer, got True", "recover.grad_accum=True"]),
        ("target_replicas", 0, ["target_replicas must be >= 1, got 0", "recover.target_replicas=0", "or null for all"]),
        ("target_replicas", 1.5, ["target_replicas must be an integer, got 1.5"]),
        ("policy", "elastic", ["unknown policy 'elastic'", "recover.policy='elastic'", "use recover.policy=static or recover.policy=adaptive"]),
        ("policy", "Static", ["unknown policy 'Static'"]),
        ("policy", None, ["unknown policy None"]),
        ("min_replicas", 0, ["min_replicas must be >= 1, got 0", "recover.min_replicas=0", "set recover.min_replicas to a positive integer"]),
        ("bucket_mb", 0, ["bucket_mb must be a positive number, got 0", "recover.bucket_mb=0", "set recover.bucket_mb"]),
        ("bucket_mb", -1.0, ["recover.bucket_mb=-1.0"]),
        ("bucket_mb", math.inf, ["recover.bucket_mb=inf"]),
        ("bucket_mb", math.nan, ["recover.bucket_mb=nan"]),
        ("bucket_mb", "4", ["recover.bucket_mb='4'"]),
        ("data_plane", "ucx", ["data_plane must be 'mpi' or 'gloo' or 'nccl', got 'ucx'", "recover.data_plane='ucx'", "set recover.data_plane=mpi (the default), gloo"]),
        ("data_plane", "Gloo", ["recover.data_plane='Gloo'"]),
        ("data_plane", None, ["data_plane must be 'mpi' or 'gloo' or 'nccl', got None"]),
        ("replica_plane", "gloo", ["replica_plane must be 'auto' or 'mpi' or 'torch', got 'gloo'", "recover.replica_plane='gloo'",
                                   "set recover.replica_plane=auto (the default), mpi (CPU) or torch"]),
        ("ledger_path", "", ["ledger_path must be a non-empty path or null, got ''", "set recover.ledger_path to a file path, or null for no ledger"]),
        ("ledger_path", 3, ["ledger_path must be a path or null, got 3"]),
        ("seed", -1, ["seed must be >= 0, got -1", "recover.seed=-1", "non-negative integer"]),
        ("seed", 1.0, ["seed must be an integer, got 1.0"]),
        ("timeout_s", 0, ["timeout_s must be a positive number of seconds, got 0", "recover.timeout_s=0", "set recover.timeout_s"]),
        ("timeout_s", math.inf, ["recover.timeout_s=inf"]),
        ("hang_timeout_s", -2, ["hang_timeout_s must be >= 0 seconds (0 = off), got -2", "recover.hang_timeout_s=-2", "or null for the launcher's --hang-timeout"]),
        ("hang_timeout_s", math.nan, ["recover.hang_timeout_s=nan"]),
        ("hang_timeout_s", "10", ["recover.hang_timeout_s='10'"]),
        ("stuck_timeout_s", -1.0, ["stuck_timeout_s must be >= 0 seconds (0 = off), got -1.0", "recover.stuck_timeout_s=-1.0", "or null for the hang timeout"]),
        ("stuck_timeout_s", False, ["recover.stuck_timeout_s=False"]),
        ("checkpoint", "x", ["recover.checkpoint='x' is not a CheckpointConfig", "CheckpointConfig(dir=..., every_n_steps=...) or a mapping"]),
        ("checkpoint", {"dir": "x", "every": 2}, ["recover.checkpoint.every is not a recover.checkpoint setting; did you mean every_n_steps?"]),
        ("sdc", 5, ["recover.sdc=5 is not an SDCConfig"]),
        ("sdc", {"action": "fix"}, ["sdc.action must be 'repair' or 'evict', got 'fix'"]),
        ("rejoin", {"hosts": ["node7", "node8"]}, ["rejoin.hosts must be a comma-separated host list, got ['node7', 'node8']",
                                                   "recover.rejoin.hosts=['node7', 'node8']", "e.g. recover.rejoin.hosts=node7,node8"]),
        ("rejoin", "yes", ["recover.rejoin='yes' is not a RejoinConfig", "pass rejoin=True/False, RejoinConfig(enabled=..."]),
    ],
)
def test_each_bad_field_is_named_with_its_fix(field: str, value: Any, needles: list[str]) -> None:
    message = refused(**{field: value})
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"every_n_steps": -1}, ["every_n_steps must be >= 0, got -1", "recover.checkpoint.every_n_steps=-1", "or 0 for no checkpoints"]),
        ({"every_n_steps": "5"}, ["every_n_steps must be an integer, got '5'"]),
        ({"every_n_steps": 3}, ["recover.checkpoint.every_n_steps=3 > 0 needs recover.checkpoint.dir", "set recover.checkpoint.dir to a directory"]),
        ({"dir": "", "every_n_steps": 1}, ["checkpoint.dir must be a non-empty path or null, got ''", "recover.checkpoint.dir=''"]),
        ({"dir": 7}, ["checkpoint.dir must be a path or null, got 7"]),
    ],
)
def test_bad_checkpoint_settings_are_named(kwargs: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ConfigurationError) as info:
        CheckpointConfig(**kwargs)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_strategy_messages_are_kept() -> None:
    # The wording ReCoVerHSDPStrategy's own checks used (tests/inprocess/test_strategy_config.py matches it).
    import re

    assert re.search("grad_accum must be >= 1, got 0", refused(grad_accum=0))
    assert re.search("unknown policy 'elastic'", refused(policy="elastic"))
    assert re.search("shards must be a positive integer, got 0", refused(shards=0))
    assert re.search(r"stuck_timeout_s must be >= 0 seconds \(0 = off\), got -1.0", refused(stuck_timeout_s=-1.0))


def test_one_error_type_for_bad_settings() -> None:
    assert issubclass(ConfigurationError, ValueError)
    from lightning_recover.workload.factory import make_policy
    from lightning_recover.workload.static_world import StaticWorld

    with pytest.raises(ConfigurationError):
        StaticWorld(W_init=2, G_init=0)
    with pytest.raises(ConfigurationError):
        make_policy("elastic", 2, 1)


def test_values_are_normalised(tmp_path: Path) -> None:
    config = RecoverConfig(
        shards=np.int64(2), bucket_mb=1, timeout_s=30, hang_timeout_s=0, stuck_timeout_s=5,  # type: ignore[arg-type]
        ledger_path=tmp_path / "ledger.jsonl",  # type: ignore[arg-type]
        checkpoint=CheckpointConfig(dir=tmp_path / "ck", every_n_steps=np.int32(3)),  # type: ignore[arg-type]
    )
    assert type(config.shards) is int and config.shards == 2
    assert type(config.bucket_mb) is float and type(config.timeout_s) is float
    assert type(config.hang_timeout_s) is float and config.hang_timeout_s == 0.0
    assert config.ledger_path == str(tmp_path / "ledger.jsonl")
    assert config.checkpoint == CheckpointConfig(dir=str(tmp_path / "ck"), every_n_steps=3)
    assert config.checkpoint.enabled and not CheckpointConfig(dir="somewhere").enabled


def test_defaults_and_frozen() -> None:
    config = RecoverConfig()
    assert (config.shards, config.grad_accum, config.target_replicas, config.policy, config.min_replicas) == (1, 1, None, "static", 1)
    assert (config.bucket_mb, config.data_plane, config.ledger_path, config.seed, config.timeout_s) == (4.0, "mpi", None, 0, 60.0)
    assert (config.hang_timeout_s, config.stuck_timeout_s, config.checkpoint) == (None, None, CheckpointConfig())
    assert config.replica_plane == "auto"
    assert config.bucket_bytes == 4 * 1024 * 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.grad_accum = 2  # type: ignore[misc]
    assert RecoverConfig(bucket_mb=1e-9).bucket_bytes == 4  # at least one float32 element
    assert POLICY_NAMES == ("static", "adaptive")


# ---------------------------------------------------------------------- builders
def test_from_mapping_builds_the_nested_checkpoint() -> None:
    config = RecoverConfig.from_mapping({"grad_accum": 2, "checkpoint": {"dir": "/ck", "every_n_steps": 5}})
    assert config == RecoverConfig(grad_accum=2, checkpoint=CheckpointConfig(dir="/ck", every_n_steps=5))
    assert RecoverConfig.from_mapping({"checkpoint": None}) == RecoverConfig()
    assert RecoverConfig.from_mapping(dataclasses.asdict(config)) == config


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"grad_acum": 2}, "recover.grad_acum is not a recover setting; did you mean grad_accum? remove it or use one of: shards, grad_accum"),
        ({"checkpoint": {"every": 2}},
         "recover.checkpoint.every is not a recover.checkpoint setting; did you mean every_n_steps? remove it or use one of: dir, every_n_steps"),
        ({"checkpoint": {"every_n_steps": 2}}, "needs recover.checkpoint.dir"),
        (["shards"], "recover=['shards'] is not a mapping of settings"),
    ],
)
def test_from_mapping_refuses_unknown_keys(settings: Any, needle: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(needle)):
        RecoverConfig.from_mapping(settings)


def test_from_arguments_maps_the_strategy_keywords(tmp_path: Path) -> None:
    config = RecoverConfig.from_arguments(grad_accum=3, checkpoint_dir=tmp_path, checkpoint_every_n_steps=2)
    assert config == RecoverConfig(grad_accum=3, checkpoint=CheckpointConfig(dir=str(tmp_path), every_n_steps=2))
    assert RecoverConfig.from_arguments() == RecoverConfig()
    # A checkpoint_dir argument asks for checkpoints: it needs a period (the strategy's rule).
    with pytest.raises(ConfigurationError, match="checkpoint_every_n_steps must be >= 1 with a checkpoint_dir, got 0; set recover.checkpoint.every_n_steps"):
        RecoverConfig.from_arguments(checkpoint_dir=tmp_path)
    with pytest.raises(ConfigurationError, match="needs recover.checkpoint.dir"):
        RecoverConfig.from_arguments(checkpoint_every_n_steps=2)
    with pytest.raises(ConfigurationError, match=re.escape("recover.grad_acum is not a recover setting; did you mean grad_accum?")):
        RecoverConfig.from_arguments(grad_acum=3)


# ---------------------------------------------------------------------- every way of passing settings (issue 34)
def test_the_strategy_keywords_take_the_groups_nested(tmp_path: Path) -> None:
    flat = RecoverConfig.from_arguments(checkpoint_dir=tmp_path, checkpoint_every_n_steps=2, sdc_action="evict")
    nested = RecoverConfig.from_arguments(checkpoint={"dir": str(tmp_path), "every_n_steps": 2}, sdc={"action": "evict"})
    assert nested == flat == RecoverConfig.from_arguments(
        checkpoint=CheckpointConfig(dir=str(tmp_path), every_n_steps=2), sdc=SDCConfig(action="evict")
    )
    assert RecoverConfig(checkpoint={"dir": "/ck"}, sdc=None).checkpoint == CheckpointConfig(dir="/ck")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"both sdc=\.\.\. and sdc_every_n_steps set recover.sdc; pass the group once"):
        RecoverConfig.from_arguments(sdc={"action": "evict"}, sdc_every_n_steps=3)


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: RecoverConfig(bucket_size=3), "recover.bucket_size is not a recover setting; did you mean bucket_mb?"),
        (lambda: CheckpointConfig(every=3), "recover.checkpoint.every is not a recover.checkpoint setting"),
        (lambda: SDCConfig(actoin="evict"), "recover.sdc.actoin is not a recover.sdc setting; did you mean action?"),
        (lambda: RecoverConfig.build(config={"polcy": "static"}), "recover.polcy is not a recover setting; did you mean policy?"),
        (lambda: RecoverConfig.build(config=3), "config=3 is not a RecoverConfig nor a mapping of its settings"),
        (lambda: RecoverConfig.build(config={}, grad_accum=2), "pass either config=RecoverConfig(...) or keyword settings, not both"),
    ],
)
def test_direct_construction_refuses_unknown_keys_by_name(build: Any, needle: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        build()
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_omegaconf_containers_are_settings() -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"grad_accum": 2, "checkpoint": {"dir": "/ck", "every_n_steps": 3}, "sdc": {"every_n_steps": 0}})
    expected = RecoverConfig(grad_accum=2, checkpoint=CheckpointConfig(dir="/ck", every_n_steps=3), sdc=SDCConfig(every_n_steps=0))
    assert RecoverConfig.build(config=cfg) == expected
    assert RecoverConfig.from_arguments(checkpoint=cfg.checkpoint, sdc=cfg.sdc, grad_accum=2) == expected
    assert RecoverConfig.build(config=OmegaConf.structured(RecoverConfig(seed=4))) == RecoverConfig(seed=4)
    with pytest.raises(ConfigurationError, match=r"recover.grad_accum has no usable value \(Missing mandatory value: grad_accum\)"):
        RecoverConfig.build(config=OmegaConf.create({"grad_accum": "???"}))
    with pytest.raises(ConfigurationError, match=r"rejoin\.hosts must be a comma-separated host list"):
        RecoverConfig.from_arguments(rejoin_hosts=OmegaConf.create(["node7"]))  # type: ignore[arg-type]
    assert RecoverConfig.build(config=OmegaConf.create({"rejoin": {"enabled": True, "standbys": 1}})).rejoin == RejoinConfig(
        enabled=True, standbys=1
    )
    with pytest.raises(ConfigurationError, match="unknown policy"):
        RecoverConfig.build(config=OmegaConf.create({"policy": {"name": "static"}}))


def test_hydra_instantiate_raises_ours_as_the_cause() -> None:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lightning_recover.runtime.refusal import configuration_error

    built = instantiate(OmegaConf.create({"_target_": "lightning_recover.config.RecoverConfig", "checkpoint": {"dir": "/ck"}}))
    assert built.checkpoint == CheckpointConfig(dir="/ck")
    with pytest.raises(InstantiationException) as info:
        instantiate(OmegaConf.create({"_target_": "lightning_recover.config.RecoverConfig", "sdc": {"every": 1}}))
    error = configuration_error(info.value)
    assert error is not None and "recover.sdc.every is not a recover.sdc setting" in str(error)


# ---------------------------------------------------------------------- the rejoin section (issue 38)
def test_the_rejoin_section_has_the_defaults_of_the_flat_fields_it_replaced() -> None:
    section = RecoverConfig().rejoin
    assert section == RejoinConfig() and not section.enabled
    assert (section.hosts, section.attempts, section.backoff_s, section.timeout_s) == (None, 3, 5.0, 120.0)
    assert (section.standbys, section.standbys_wait_s) == (0, 60.0)
    assert RecoverConfig(rejoin=True).rejoin == RejoinConfig(enabled=True)  # a bool is the section's switch
    assert RecoverConfig(rejoin=False) == RecoverConfig() == RecoverConfig(rejoin=None)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        section.standbys = 2  # type: ignore[misc]


def test_the_section_and_its_short_form_give_equal_configs() -> None:
    from omegaconf import OmegaConf

    section = {"enabled": True, "hosts": "node7,node8", "attempts": 2, "backoff_s": 0.5, "timeout_s": 30, "standbys": 1,
               "standbys_wait_s": 0}
    short = {"rejoin": True, **{f"rejoin_{k}": v for k, v in section.items() if k != "enabled"}}
    expected = RecoverConfig(rejoin=RejoinConfig(**section))
    assert expected.rejoin.timeout_s == 30.0 and type(expected.rejoin.timeout_s) is float
    spellings = {
        "constructor, mapping": RecoverConfig(rejoin=section),  # type: ignore[arg-type]
        "build, section": RecoverConfig.build(rejoin=section),
        "build, RejoinConfig": RecoverConfig.build(rejoin=RejoinConfig(**section)),
        "build, short form": RecoverConfig.build(**short),
        "from_mapping, section": RecoverConfig.from_mapping({"rejoin": section}),
        "from_mapping, short form": RecoverConfig.from_mapping(short),
        "config=DictConfig, section": RecoverConfig.build(config=OmegaConf.create({"rejoin": section})),
        "config=DictConfig, short form": RecoverConfig.build(config=OmegaConf.create(short)),
    }
    for how, config in spellings.items():
        assert config == expected, how
    # Only some flat keys: the rest at the section's defaults; without rejoin=True re-join stays off.
    assert RecoverConfig.build(rejoin_standbys=2) == RecoverConfig(rejoin=RejoinConfig(standbys=2))


def test_a_typo_in_the_rejoin_section_names_the_key_and_the_fix() -> None:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lightning_recover.runtime.refusal import configuration_error

    needle = ("recover.rejoin.standby is not a recover.rejoin setting; did you mean standbys? "
              "remove it or use one of: enabled, hosts, attempts, backoff_s, timeout_s, standbys, standbys_wait_s")
    for build in (
        lambda: RecoverConfig.from_mapping({"rejoin": {"standby": 1}}),
        lambda: RecoverConfig.build(config=OmegaConf.create({"rejoin": {"enabled": True, "standby": 1}})),
        lambda: RecoverConfig.build(rejoin={"standby": 1}),
        lambda: RecoverConfig(rejoin={"standby": 1}),  # type: ignore[arg-type]
        lambda: RejoinConfig(standby=1),  # type: ignore[call-arg]
    ):
        with pytest.raises(ConfigurationError) as info:
            build()
        assert needle in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(InstantiationException) as hydra_info:
        instantiate(OmegaConf.create({"_target_": "lightning_recover.config.RecoverConfig", "rejoin": {"standby": 1}}))
    assert needle in str(configuration_error(hydra_info.value))
    # A typo in the short form is named with the nearest short form.
    with pytest.raises(ConfigurationError, match=re.escape("recover.rejoin_standby is not a recover setting; did you mean rejoin_standbys?")):
        RecoverConfig.build(rejoin_standby=1)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("section", "needles"),
    [
        ({"enabled": "yes"}, ["rejoin.enabled must be true or false, got 'yes' (recover.rejoin.enabled='yes')",
                              "set recover.rejoin.enabled=true to spawn replacements"]),
        ({"hosts": " "}, ["rejoin.hosts must be a comma-separated host list, got ' '", "e.g. recover.rejoin.hosts=node7,node8"]),
        ({"attempts": 0}, ["rejoin.attempts must be >= 1, got 0 (recover.rejoin.attempts=0)", "set recover.rejoin.attempts to a positive integer"]),
        ({"attempts": 2.0}, ["rejoin.attempts must be an integer, got 2.0"]),
        ({"backoff_s": -1}, ["rejoin.backoff_s must be a number of seconds, got -1 (recover.rejoin.backoff_s=-1)",
                             "set recover.rejoin.backoff_s to the seconds between spawn attempts"]),
        ({"timeout_s": 0}, ["rejoin.timeout_s must be a number of seconds, got 0", "set recover.rejoin.timeout_s"]),
        ({"timeout_s": math.inf}, ["recover.rejoin.timeout_s=inf"]),
        ({"standbys": -1}, ["rejoin.standbys must be >= 0, got -1 (recover.rejoin.standbys=-1)", "set recover.rejoin.standbys"]),
        ({"standbys_wait_s": math.nan}, ["recover.rejoin.standbys_wait_s=nan", "set recover.rejoin.standbys_wait_s"]),
    ],
)
def test_each_bad_rejoin_value_is_named_in_either_spelling(section: dict[str, Any], needles: list[str]) -> None:
    (key, value), = section.items()
    builds = [lambda: RejoinConfig(**section), lambda: RecoverConfig.build(rejoin=section)]
    if key != "enabled":  # the short form of enabled is rejoin=<bool>: a non-bool there is not the switch
        builds.append(lambda: RecoverConfig.build(**{f"rejoin_{key}": value}))
    for build in builds:
        with pytest.raises(ConfigurationError) as info:
            build()
        message = str(info.value)
        for needle in needles:
            assert needle in message, message
        assert "\n" not in message, message
    if key == "enabled":
        with pytest.raises(ConfigurationError, match=re.escape("recover.rejoin='yes' is not a RejoinConfig; pass rejoin=True/False")):
            RecoverConfig.build(rejoin=value)


def test_the_short_form_and_the_section_are_not_mixed() -> None:
    with pytest.raises(ConfigurationError, match=re.escape(
        "both rejoin=... and rejoin_hosts set recover.rejoin; pass the section once: either rejoin={'hosts': ...}"
    )):
        RecoverConfig.build(rejoin={"enabled": True}, rejoin_hosts="node7")
    with pytest.raises(ConfigurationError, match="both rejoin=... and rejoin_standbys"):
        RecoverConfig.from_mapping({"rejoin": RejoinConfig(), "rejoin_standbys": 1})
    # The dataclass's own constructor keeps to its fields: a short form there says how to spell it.
    with pytest.raises(ConfigurationError, match=re.escape(
        "recover.rejoin_standbys is a short form that RecoverConfig(...) does not take; write rejoin={'standbys': ...} "
        "(recover.rejoin.standbys), or pass rejoin_standbys=... to RecoverConfig.build(...)"
    )):
        RecoverConfig(rejoin_standbys=1)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match=re.escape("recover.checkpoint_dir is a short form")):
        RecoverConfig(checkpoint_dir="/ck")  # type: ignore[call-arg]
    # A Hydra group spells the whole section: there a flat key the user adds wins over it.
    folded = fold_short_forms({"rejoin": {"enabled": True, "standbys": 0}, "rejoin_standbys": 2}, flat_over_section=True)
    assert folded == {"rejoin": {"enabled": True, "standbys": 2}}
    assert fold_short_forms({"shards": 2, "rejoin": False}) == {"shards": 2, "rejoin": {"enabled": False}}


# ---------------------------------------------------------------------- typed keywords (issue 38)
def _members(hint: Any) -> set[Any]:
    """The types a hint allows: the members of a union, or the hint itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return set(typing.get_args(hint))
    return {hint}


def test_recover_settings_types_every_field_and_short_form() -> None:
    # The TypedDict the strategy's **settings are typed with cannot drift from the dataclass: a field
    # added to RecoverConfig (or a short form to the builders) fails here until RecoverSettings has it.
    keys = typing.get_type_hints(RecoverSettings)
    field_names = [f.name for f in dataclasses.fields(RecoverConfig)]
    assert set(keys) == set(field_names) | set(SHORT_FORMS)
    assert not set(field_names) & set(SHORT_FORMS)
    assert RecoverSettings.__total__ is False and not RecoverSettings.__required_keys__
    # Each key allows at least what the field (or, for a short form, the section's field) holds.
    fields = typing.get_type_hints(RecoverConfig)
    sections = {"checkpoint": CheckpointConfig, "sdc": SDCConfig, "rejoin": RejoinConfig}
    for key, hint in keys.items():
        if key in fields:
            wanted = fields[key]
        else:
            group, name = key.split("_", 1)
            wanted = typing.get_type_hints(sections[group])[name]
        assert _members(wanted) <= _members(hint), (key, wanted, hint)
    assert bool in _members(keys["rejoin"]) and RejoinConfig in _members(keys["rejoin"])
    # And every key is one the builders take (with the value of a default config).
    defaults = dataclasses.asdict(RecoverConfig())
    for key in keys:
        if key in defaults:
            value = defaults[key]
        else:
            group, name = key.split("_", 1)
            value = defaults[group][name]
        if key == "checkpoint_dir":
            continue  # a flat checkpoint_dir asks for checkpoints: tested with a period above
        RecoverConfig.build(**{key: value})


# ---------------------------------------------------------------------- the job's size
@pytest.mark.parametrize(
    ("kwargs", "world", "needles"),
    [
        ({"shards": 3}, 4, ["recover.shards=3 does not divide the world size 4", "launch a multiple of 3 ranks", "a divisor of 4"]),
        ({"shards": 2}, 1, ["recover.shards=2 does not divide the world size 1"]),
        ({"target_replicas": 5}, 4, ["recover.target_replicas=5 but the job has 4 replicas (4 ranks / 1 shards)", "set recover.target_replicas <= 4"]),
        ({"target_replicas": 2}, 1, ["target_replicas=2 but the job has 1 replicas"]),
        ({"policy": "adaptive", "target_replicas": 2}, 4, ["recover.target_replicas=2 with recover.policy=adaptive", "set recover.target_replicas=null"]),
        ({"min_replicas": 3, "shards": 2}, 4, ["recover.min_replicas=3 but the job has 2 replicas", "lower it or launch more ranks"]),
        ({}, 0, ["world size must be a positive integer, got 0"]),
    ],
)
def test_check_world_names_the_setting(kwargs: dict[str, Any], world: int, needles: list[str]) -> None:
    with pytest.raises(ConfigurationError) as info:
        RecoverConfig(**kwargs).check_world(world)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_sizes_of_the_job() -> None:
    config = RecoverConfig(shards=2, grad_accum=3, target_replicas=3)
    assert (config.replicas(8), config.target(8), config.microbatches_per_step(8)) == (4, 3, 9)
    assert RecoverConfig(grad_accum=2).microbatches_per_step(4) == 8  # T = all 4 replicas
    RecoverConfig(policy="adaptive", target_replicas=4).check_world(4)  # T = W is no spare: allowed


@pytest.mark.parametrize(
    ("hang", "stuck", "launcher", "expected"),
    [
        (None, None, 10.0, (10.0, 10.0)),  # the launcher's default; stuck follows hang
        (4.0, None, 10.0, (4.0, 4.0)),
        (4.0, 30.0, 10.0, (4.0, 30.0)),
        (None, 0.0, 10.0, (10.0, None)),  # 0 = off
        (0.0, None, 10.0, (None, None)),  # hang detection off: stuck follows
        (None, None, None, (None, None)),  # the launcher turned it off
        (None, 5.0, None, (None, 5.0)),
    ],
)
def test_watchdog_timeouts(hang: float | None, stuck: float | None, launcher: float | None, expected: tuple[Any, Any]) -> None:
    assert RecoverConfig(hang_timeout_s=hang, stuck_timeout_s=stuck).watchdog_timeouts(launcher) == expected


# ---------------------------------------------------------------------- properties
valid_settings = st.fixed_dictionaries(
    {
        "shards": st.integers(1, 8),
        "grad_accum": st.integers(1, 64),
        "target_replicas": st.none() | st.integers(1, 16),
        "policy": st.sampled_from(POLICY_NAMES),
        "min_replicas": st.integers(1, 16),
        "bucket_mb": st.floats(1e-6, 1e4) | st.integers(1, 100),
        "ledger_path": st.none() | st.text(min_size=1, max_size=20).filter(lambda t: "\x00" not in t),
        "seed": st.integers(0, 2**63),
        "timeout_s": st.floats(1e-3, 1e6),
        "hang_timeout_s": st.none() | st.floats(0, 1e6) | st.just(math.inf),
        "stuck_timeout_s": st.none() | st.floats(0, 1e6),
        "rejoin": st.booleans() | st.builds(
            RejoinConfig, enabled=st.booleans(), hosts=st.none() | st.sampled_from(["node7", "node7:2,node8"]),
            attempts=st.integers(1, 10), backoff_s=st.floats(0, 1e3), timeout_s=st.floats(1e-3, 1e4),
            standbys=st.integers(0, 4), standbys_wait_s=st.floats(0, 1e3),
        ),
    }
)


def flat_form(config: RecoverConfig) -> dict[str, Any]:
    """``dataclasses.asdict(config)`` as a RecoverConfig before the rejoin section had it: ``rejoin`` a bool, ``rejoin_*`` beside it."""
    old = dataclasses.asdict(config)
    section = old.pop("rejoin")
    old["rejoin"] = section.pop("enabled")
    old.update({f"rejoin_{name}": value for name, value in section.items()})
    return old


@given(valid_settings, st.none() | st.integers(1, 1000))
def test_any_valid_combination_constructs_and_round_trips(settings: dict[str, Any], every: int | None) -> None:
    checkpoint = CheckpointConfig() if every is None else CheckpointConfig(dir="ck", every_n_steps=every)
    config = RecoverConfig(**settings, checkpoint=checkpoint)
    assert isinstance(config.rejoin, RejoinConfig)
    assert RecoverConfig.from_mapping(dataclasses.asdict(config)) == config
    assert RecoverConfig.from_mapping(flat_form(config)) == config  # a mapping stored before the section
    assert RecoverConfig.build(**flat_form(config)) == config
    assert dataclasses.replace(config) == config


@given(valid_settings, st.integers(1, 64))
def test_check_world_accepts_exactly_the_jobs_that_fit(settings: dict[str, Any], world: int) -> None:
    config = RecoverConfig(**settings)
    divides = world % config.shards == 0
    replicas = world // config.shards
    target = config.target_replicas
    fits = divides and (target is None or target <= replicas) and config.min_replicas <= replicas
    if config.policy == "adaptive":
        fits = fits and target in (None, replicas)
    try:
        config.check_world(world)
    except ConfigurationError as exc:
        assert not fits, exc
        assert "recover." in str(exc) and "; " in str(exc)  # names the setting, then the fix
    else:
        assert fits
        assert config.microbatches_per_step(world) == (target or replicas) * config.grad_accum


@given(st.sampled_from(["shards", "grad_accum", "min_replicas", "target_replicas"]), st.integers(-10**6, 0))
def test_any_integer_below_one_is_refused_by_name(field: str, value: int) -> None:
    message = refused(**{field: value})
    assert f"recover.{field}={value}" in message and f"set recover.{field}" in message


@given(st.sampled_from(["hang_timeout_s", "stuck_timeout_s", "timeout_s", "bucket_mb"]), st.floats(max_value=-1e-9) | st.just(math.nan))
def test_any_negative_duration_or_size_is_refused_by_name(field: str, value: float) -> None:
    message = refused(**{field: value})
    assert f"recover.{field}={value!r}" in message and f"set recover.{field}" in message


def test_import_is_pure_and_fast() -> None:
    # Launchers and Hydra scripts validate settings before any heavy layer loads.
    code = (
        "import sys, time; t = time.perf_counter(); import lightning_recover.config, lightning_recover.workload.factory; "
        "dt = time.perf_counter() - t; heavy = [m for m in ('torch', 'mpi4py', 'lightning', 'omegaconf', 'numpy') if m in sys.modules]; "
        "print(heavy, dt)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=dict(os.environ)).stdout
    heavy, seconds = out.rsplit(" ", 1)
    assert heavy == "[]", out
    assert float(seconds) < 0.5, out
