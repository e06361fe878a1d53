"""Exact resume: a run stopped after step k and resumed in a fresh Loop ends bitwise equal to
an uninterrupted run, computed by a hand-written loop (the seeds' plain loop)."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, EarlyStopping, Metrics

from builders import Crash, RaiseAfterStep, RaiseAtBatch

#: Raises `Crash` once the loop has completed optimizer step ``k`` (like a crash right after).
CrashAfterStep = functools.partial(RaiseAfterStep, boundary=True)

SAMPLES, BATCH, EPOCHS = 23, 5, 3  # 5 batches per epoch, the last one of 3 samples
STEPS_PER_EPOCH = math.ceil(SAMPLES / BATCH)
TOTAL = STEPS_PER_EPOCH * EPOCHS


def dataset() -> tuple[TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(123)
    inputs = torch.randn(SAMPLES, 4, generator=generator)
    targets = inputs @ torch.randn(4, 1, generator=generator) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    val_inputs = torch.randn(9, 4, generator=generator)
    return TensorDataset(inputs, targets), TensorDataset(val_inputs, val_inputs.sum(1, keepdim=True))


def fresh_objects() -> tuple[nn.Module, torch.optim.Optimizer, DataLoader, DataLoader]:
    """Fresh model, optimizer and loaders, seeded as a user script would seed them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train, val = dataset()
    loader = DataLoader(train, batch_size=BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(7))
    return model, optimizer, loader, DataLoader(val, batch_size=4)


def hand_written(epochs: int = EPOCHS, accumulate: int = 1) -> nn.Module:
    """The seeds' loop: train, then validate under no_grad; accumulation as in the seeds
    (each micro-batch loss divided by its window's real size, a partial last window stepped)."""
    model, optimizer, loader, val_loader = fresh_objects()
    loss_fn = nn.functional.mse_loss
    batches = len(loader)
    for _ in range(epochs):
        model.train()
        for index, (inputs, targets) in enumerate(loader):
            window_start = index - index % accumulate
            size = min(accumulate, batches - window_start)
            loss = loss_fn(model(inputs), targets)
            (loss / size if size > 1 else loss).backward()
            if (index + 1) % accumulate == 0 or index == batches - 1:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            for inputs, targets in val_loader:
                loss_fn(model(inputs), targets)
    return model


def run(directory: Path, extra: list[Callback], *, resume: bool | str = False,
        every_n_steps: int | None = None, epochs: int = EPOCHS, accumulate: int = 1,
        early_stopping: bool = True) -> tuple[Loop, nn.Module]:
    model, optimizer, loader, val_loader = fresh_objects()
    callbacks: list[Callback] = []
    if accumulate > 1:
        from hookloop.callbacks import GradAccumulation

        callbacks.append(GradAccumulation(accumulate))
    callbacks.append(Metrics(mae=lambda out, y: (out - y).abs().mean(), on_train=True))
    if early_stopping:
        callbacks.append(EarlyStopping(patience=100))
    callbacks.append(Checkpoint(directory, every_n_steps=every_n_steps, keep_last=2, resume=resume))
    loop = Loop(model, optimizer, loader, val_data=val_loader, loss_fn=nn.functional.mse_loss,
                callbacks=callbacks + extra, device="cpu")
    loop.fit(epochs)
    return loop, model


def assert_same_weights(model: nn.Module, expected: nn.Module) -> None:
    for (name, value), (_, reference) in zip(model.state_dict().items(),
                                              expected.state_dict().items()):
        assert torch.equal(value, reference), f"{name} differs from the uninterrupted run"


@pytest.fixture(scope="module")
def uninterrupted() -> nn.Module:
    return hand_written()


# k = 5 and 10 are the last steps of epochs 0 and 1; k = 15 is the very last step.
@pytest.mark.parametrize("every_n_steps", [None, 2])
@pytest.mark.parametrize("k", [1, 3, 5, 6, 10, 14, 15])
def test_crash_after_step_k_then_resume_is_exact(tmp_path: Path, uninterrupted: nn.Module,
                                                 k: int, every_n_steps: int | None) -> None:
    with pytest.raises(Crash):
        run(tmp_path, [CrashAfterStep(k)], every_n_steps=every_n_steps)
    newest = Checkpoint(tmp_path).files.rotating()[-1]
    assert torch.load(newest, weights_only=True)["loop"]["step"] == k
    loop, model = run(tmp_path, [], resume=True, every_n_steps=every_n_steps)
    assert loop.state.step == TOTAL
    assert_same_weights(model, uninterrupted)


@pytest.mark.filterwarnings("ignore:Checkpoint.*has no state:RuntimeWarning")
def test_resume_from_every_step_file(tmp_path: Path, uninterrupted: nn.Module) -> None:
    """Each file written by every_n_steps=1 is a valid resume point."""
    model, optimizer, loader, val_loader = fresh_objects()
    loop = Loop(model, optimizer, loader, val_data=val_loader, loss_fn=nn.functional.mse_loss,
                callbacks=[Checkpoint(tmp_path / "all", every_n_steps=1, keep_last=None)],
                device="cpu")
    loop.fit(EPOCHS)
    files = Checkpoint(tmp_path / "all").files.rotating()
    assert len(files) == TOTAL
    for path in files[:-1:2]:
        loop, model = run(tmp_path / "resumed", [], resume=str(path), early_stopping=False)
        assert loop.state.step == TOTAL
        assert_same_weights(model, uninterrupted)


def test_resumed_run_reports_the_same_metrics(tmp_path: Path) -> None:
    reference, _ = run(tmp_path / "reference", [])
    with pytest.raises(Crash):
        run(tmp_path / "crashed", [CrashAfterStep(12)])
    resumed, _ = run(tmp_path / "crashed", [], resume=True)
    assert resumed.state.metrics == reference.state.metrics
    assert set(resumed.state.metrics) >= {"train_loss", "val_loss", "train_mae", "val_mae"}


@pytest.mark.parametrize("accumulate, crash", [(2, (1, 3)), (2, (1, 4)), (3, (2, 1))])
def test_crash_inside_an_accumulation_window(tmp_path: Path, accumulate: int,
                                             crash: tuple[int, int]) -> None:
    expected = hand_written(accumulate=accumulate)
    with pytest.raises(Crash):
        run(tmp_path, [RaiseAtBatch(*crash)], accumulate=accumulate)  # mid-window
    loop, model = run(tmp_path, [], resume=True, accumulate=accumulate)
    assert_same_weights(model, expected)


def test_resume_true_over_an_empty_directory_starts_fresh(tmp_path: Path,
                                                          uninterrupted: nn.Module) -> None:
    loop, model = run(tmp_path / "new", [], resume=True)
    assert loop.state.step == TOTAL
    assert_same_weights(model, uninterrupted)


def test_a_finished_run_resumed_does_nothing_more(tmp_path: Path, uninterrupted: nn.Module) -> None:
    run(tmp_path, [])
    loop, model = run(tmp_path, [], resume=True)
    assert loop.state.step == TOTAL
    assert_same_weights(model, uninterrupted)


def test_integration_with_ema_and_lr_scheduler(tmp_path: Path) -> None:
    """EMA shadow and scheduler position come back too: the resumed run ends where an
    uninterrupted one does, EMA weights and learning rate included."""
    from hookloop.callbacks import EMA, LRScheduler

    def stack() -> list[Callback]:
        return [LRScheduler(lambda optimizer, total: torch.optim.lr_scheduler.StepLR(optimizer, 4, 0.5)),
                EMA(0.9)]

    def fit(directory: Path, extra: list[Callback], resume: bool) -> tuple[Loop, list[Callback]]:
        model, optimizer, loader, val_loader = fresh_objects()
        callbacks = stack()
        loop = Loop(model, optimizer, loader, val_data=val_loader, loss_fn=nn.functional.mse_loss,
                    callbacks=[*callbacks, Checkpoint(directory, monitor="val_loss",
                                                      every_n_steps=3, resume=resume), *extra],
                    device="cpu")
        loop.fit(EPOCHS)
        return loop, callbacks

    reference, reference_callbacks = fit(tmp_path / "a", [], False)
    with pytest.raises(Crash):
        fit(tmp_path / "b", [CrashAfterStep(7)], False)
    resumed, resumed_callbacks = fit(tmp_path / "b", [], True)
    assert_same_weights(resumed.model, reference.model)
    assert resumed.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
    for mine, theirs in zip(resumed_callbacks[1].averaged_state_dict().values(),
                            reference_callbacks[1].averaged_state_dict().values()):
        assert torch.equal(mine, theirs)
    assert os.path.exists(tmp_path / "b" / "best.pt")


@pytest.mark.parametrize("k", [4, 5, 8])
def test_crash_at_the_end_of_an_evenly_divided_epoch(tmp_path: Path, k: int) -> None:
    """With 20 samples in batches of 5, RandomSampler draws one more permutation from the
    loader's generator *after* the last batch (when the iterator is exhausted): a resume
    from the last step of an epoch must replay that draw, or the next epoch's order differs."""
    global SAMPLES
    saved, SAMPLES = SAMPLES, 20
    try:
        expected = hand_written(epochs=2)
        with pytest.raises(Crash):
            run(tmp_path, [CrashAfterStep(k)], epochs=2)
        loop, model = run(tmp_path, [], resume=True, epochs=2)
        assert loop.state.step == 8
        assert_same_weights(model, expected)
    finally:
        SAMPLES = saved


def test_integration_with_amp_float16_scaler(tmp_path: Path) -> None:
    """The GradScaler's scale and growth tracker come back: the resumed run ends with the
    weights and the scale of an uninterrupted one (CPU float16 autocast)."""
    from hookloop.callbacks import AMP, GradClip

    def fit(directory: Path, extra: list[Callback], resume: bool) -> tuple[Loop, Callback]:
        model, optimizer, loader, val_loader = fresh_objects()
        amp = AMP(torch.float16, scaler={"init_scale": 2.0 ** 10, "growth_interval": 3})
        loop = Loop(model, optimizer, loader, val_data=val_loader, loss_fn=nn.functional.mse_loss,
                    callbacks=[amp, GradClip(1.0), Checkpoint(directory, resume=resume), *extra],
                    device="cpu")
        loop.fit(EPOCHS)
        return loop, amp

    reference, reference_amp = fit(tmp_path / "a", [], False)
    with pytest.raises(Crash):
        fit(tmp_path / "b", [CrashAfterStep(8)], False)
    resumed, resumed_amp = fit(tmp_path / "b", [], True)
    assert resumed.state.step == reference.state.step
    assert_same_weights(resumed.model, reference.model)
    assert resumed_amp.state_dict() == reference_amp.state_dict()
