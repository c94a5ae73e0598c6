"""Single-process (MPI singleton) checks of the strategy's Lightning contract and its refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from examples.model import GPT, SIZES, ByteDataset, read_corpus

from lightning_recover.audit.ledger import read_ledger  # noqa: E402
from lightning_recover.audit.ledger_check import check_ledger  # noqa: E402
from lightning_recover.comm.replica_plane import resolve_replica_plane  # noqa: E402
from lightning_recover.strategies import ConfigurationError, ReCoVerHSDPStrategy  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data() -> ByteDataset:
    return ByteDataset(read_corpus(max_bytes=60_000), SIZES["tiny"]["block_size"])


def fit(strategy: ReCoVerHSDPStrategy | str, data, steps: int = 2, **trainer_kw) -> tuple[L.Trainer, GPT]:
    L.seed_everything(0, verbose=False)
    model = GPT(**SIZES["tiny"], dropout=0.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer_kw,
    )
    try:
        trainer.fit(model, data if isinstance(data, DataLoader) else DataLoader(data, batch_size=2))
    finally:
        if isinstance(trainer.strategy, ReCoVerHSDPStrategy):
            trainer.strategy.shutdown()
    return trainer, model


def test_registered_name_and_lightning_hooks(data: ByteDataset, tmp_path: Path) -> None:
    seen: dict[str, list] = {"before_opt": [], "lr": []}

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # type: ignore[no-untyped-def]
            seen["before_opt"].append(trainer.global_step)
            seen["lr"].append(optimizer.param_groups[0]["lr"])

    strategy = ReCoVerHSDPStrategy(grad_accum=3, ledger_path=tmp_path / "ledger.jsonl")
    trainer, _ = fit(strategy, data, steps=3, callbacks=[Probe()])
    assert trainer.global_step == 3
    assert seen["before_opt"] == [0, 1, 2], "on_before_optimizer_step once per committed step"
    assert seen["lr"][0] < seen["lr"][1] < seen["lr"][2], "the LR scheduler advances once per committed step"
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [line["committed"] for line in ledger] == [3, 3, 3]
    assert check_ledger(tmp_path / "ledger.jsonl").ok


def test_strategy_by_name(data: ByteDataset) -> None:
    import lightning_recover.strategies  # noqa: F401  (registers "recover_hsdp")

    trainer, _ = fit("recover_hsdp", data, steps=1)
    assert isinstance(trainer.strategy, ReCoVerHSDPStrategy)
    assert trainer.global_step == 1


def test_bf16_mixed_runs_and_matches_fp32_closely(data: ByteDataset, tmp_path: Path) -> None:
    _, m32 = fit(ReCoVerHSDPStrategy(grad_accum=2, ledger_path=tmp_path / "a.jsonl"), data, precision="32-true")
    _, m16 = fit(ReCoVerHSDPStrategy(grad_accum=2, ledger_path=tmp_path / "b.jsonl"), data, precision="bf16-mixed")
    l32 = [x["loss"] for x in read_ledger(tmp_path / "a.jsonl")]
    l16 = [x["loss"] for x in read_ledger(tmp_path / "b.jsonl")]
    assert l16 == pytest.approx(l32, rel=2e-2)
    assert all(p.dtype == torch.float32 for p in m16.parameters()), "bf16-mixed keeps fp32 master weights"


def test_a_recovery_hook_on_a_plain_callback_refused(data: ByteDataset) -> None:
    # Hooks are typed calls on RecoveryHooks instances: this method would never be called, so setup says so.
    class Alert(L.Callback):
        def on_world_repaired(self, trainer, pl_module, repair, step):  # type: ignore[no-untyped-def]
            pass

    with pytest.raises(ConfigurationError, match="Alert defines the recovery hook.*on_world_repaired.*subclass.*RecoveryCallback"):
        fit(ReCoVerHSDPStrategy(), data, callbacks=[Alert()])


def test_accumulate_grad_batches_refused(data: ByteDataset) -> None:
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches=2.*recover.grad_accum"):
        fit(ReCoVerHSDPStrategy(), data, accumulate_grad_batches=2)


def test_fp16_with_grad_scaler_refused(data: ByteDataset) -> None:
    # On CPU Lightning turns precision="16-mixed" into bf16; hand it the GPU-style plugin directly.
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ConfigurationError, match="GradScaler.*bf16-mixed"):
        fit(ReCoVerHSDPStrategy(), data, plugins=[plugin])


def test_iterable_dataset_refused() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            while True:
                yield torch.zeros(32, dtype=torch.long), torch.zeros(32, dtype=torch.long)

    with pytest.raises(ConfigurationError, match="not map-style"):
        fit(ReCoVerHSDPStrategy(), DataLoader(Stream(), batch_size=2))


def test_dataset_too_small_refused() -> None:
    tiny = ByteDataset(b"x" * 200, SIZES["tiny"]["block_size"])
    with pytest.raises(ValueError, match="dataset has 6 samples but one step needs"):
        fit(ReCoVerHSDPStrategy(grad_accum=4), tiny)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grad_accum": 0}, "grad_accum must be >= 1, got 0"),
        ({"policy": "elastic"}, "unknown policy 'elastic'"),
        ({"shards": 0}, "shards must be a positive integer, got 0"),
        ({"stuck_timeout_s": -1.0}, r"stuck_timeout_s must be >= 0 seconds \(0 = off\), got -1.0"),
    ],
)
def test_bad_arguments_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        ReCoVerHSDPStrategy(**kwargs)


def test_progress_hooks_tick_per_layer_in_forward_and_backward_and_change_nothing(data: ByteDataset) -> None:
    from lightning_recover.strategies.probes import install_progress_hooks

    x, y = (torch.stack(t) for t in zip(*(data[i] for i in range(2))))

    def grads(hooked: bool, spacing_s: float = 0.0) -> tuple[list[torch.Tensor], int, int]:
        torch.manual_seed(0)
        model = GPT(**SIZES["tiny"], dropout=0.0)
        ticks = [0]
        if hooked:
            install_progress_hooks(model, lambda: ticks.__setitem__(0, ticks[0] + 1), grad_spacing_s=spacing_s)
        loss = model.training_step((x, y), 0)
        in_forward = ticks[0]
        loss.backward()
        return [p.grad.clone() for p in model.parameters()], in_forward, ticks[0] - in_forward

    plain, _, _ = grads(False)
    hooked, forward_ticks, backward_ticks = grads(True)
    layers = SIZES["tiny"]["n_layer"]
    assert forward_ticks >= 4 * layers  # several per block (norms, attention, MLP), not one per microbatch
    assert backward_ticks >= 2 * layers  # and again as gradients flow back through them
    for a, b in zip(plain, hooked):
        assert torch.equal(a, b)
    # Outputs closer than the spacing in forward time get no gradient tick: the first output only, here.
    spaced, spaced_forward_ticks, spaced_backward_ticks = grads(True, spacing_s=3600.0)
    assert spaced_forward_ticks == forward_ticks and spaced_backward_ticks == 1
    for a, b in zip(plain, spaced):
        assert torch.equal(a, b)


def test_stuck_detection_defaults_to_the_hang_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_RECOVER_HANG_TIMEOUT", raising=False)
    assert ReCoVerHSDPStrategy().stuck_timeout_s == 10.0
    assert ReCoVerHSDPStrategy(hang_timeout_s=4).stuck_timeout_s == 4
    assert ReCoVerHSDPStrategy(hang_timeout_s=4, stuck_timeout_s=30).stuck_timeout_s == 30
    assert ReCoVerHSDPStrategy(stuck_timeout_s=0).stuck_timeout_s is None
    monkeypatch.setenv("LIGHTNING_RECOVER_HANG_TIMEOUT", "0")
    assert ReCoVerHSDPStrategy().stuck_timeout_s is None  # hang detection off: the watchdog is off


def test_target_replicas_above_replicas_refused(data: ByteDataset) -> None:
    with pytest.raises(ConfigurationError, match="target_replicas=2 but the job has 1 replicas"):
        fit(ReCoVerHSDPStrategy(target_replicas=2), data)


def test_nccl_data_plane_refused_without_cuda(data: ByteDataset) -> None:
    with pytest.raises(ConfigurationError, match=r"recover.data_plane=nccl needs the gradients on CUDA.*recover.data_plane=gloo or mpi"):
        fit(ReCoVerHSDPStrategy(data_plane="nccl"), data)


@pytest.mark.parametrize(
    ("setting", "data_plane", "device", "expected"),
    [("auto", "mpi", "cpu", "mpi"), ("auto", "gloo", "cpu", "torch"), ("auto", "mpi", "cuda", "torch"),
     ("auto", "nccl", "cuda", "torch"), ("mpi", "gloo", "cpu", "mpi"), ("torch", "mpi", "cpu", "torch"),
     ("torch", "nccl", "cuda", "torch")],
)
def test_replica_plane_auto_picks_mpi_only_on_cpu_with_the_mpi_data_plane(setting: str, data_plane: str, device: str, expected: str) -> None:
    assert resolve_replica_plane(setting, data_plane, device) == expected


def test_mpi_replica_plane_refused_on_cuda() -> None:
    with pytest.raises(ConfigurationError, match=r"replica_plane=mpi .* runs on cuda; use recover.replica_plane=torch"):
        resolve_replica_plane("mpi", "mpi", "cuda")


def test_single_process_fit_reports_its_replica_plane(data: ByteDataset) -> None:
    strategy = ReCoVerHSDPStrategy(replica_plane="torch")
    fit(strategy, data)
    assert strategy.replica_plane == "torch" and strategy.replica_plane_calls == 0
    strategy = ReCoVerHSDPStrategy()
    fit(strategy, data)
    assert strategy.replica_plane == "mpi" and strategy.replica_plane_calls == 0  # one shard: no FSDP2 collective


def test_iterable_dataset_with_len_refused() -> None:
    class SizedStream(IterableDataset):
        def __len__(self) -> int:
            return 1000

        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            while True:
                yield torch.zeros(32, dtype=torch.long), torch.zeros(32, dtype=torch.long)

    with pytest.raises(ConfigurationError, match="not map-style"):
        fit(ReCoVerHSDPStrategy(), DataLoader(SizedStream(), batch_size=2))


def test_the_keyword_settings_are_typed_by_recover_settings() -> None:
    # What an IDE or a type checker reads (issue 38): **settings is Unpack[RecoverSettings], whose keys
    # tests/launched/test_config.py keeps equal to RecoverConfig's fields plus the short forms. No type
    # checker runs here (none is installed): this pins the annotations that make one catch a typo.
    import typing

    import typing_extensions

    from lightning_recover.config import RecoverConfig, RecoverSettings

    unpack = {typing_extensions.Unpack, getattr(typing, "Unpack", typing_extensions.Unpack)}
    for function in (ReCoVerHSDPStrategy.__init__, RecoverConfig.build, RecoverConfig.from_arguments):
        hints = typing.get_type_hints(function, include_extras=True)
        assert typing.get_origin(hints["settings"]) in unpack, (function, hints["settings"])
        assert typing.get_args(hints["settings"]) == (RecoverSettings,), function
    config = typing.get_type_hints(ReCoVerHSDPStrategy.__init__)["config"]
    assert RecoverConfig in typing.get_args(config) and type(None) in typing.get_args(config)
    # At run time the same typo is refused by name, with the nearest keyword.
    with pytest.raises(ConfigurationError, match=r"recover.rejoin_standby is not a recover setting; did you mean rejoin_standbys\?"):
        ReCoVerHSDPStrategy(rejoin=True, rejoin_standby=1)  # type: ignore[call-arg]
    strategy = ReCoVerHSDPStrategy(rejoin=True, rejoin_standbys=1)
    assert strategy.config == ReCoVerHSDPStrategy(rejoin={"enabled": True, "standbys": 1}).config
