"""Data that draws from Python's and NumPy's global generators (augmentation in a map-style
dataset's __getitem__, as many hand-written datasets do): a killed-and-relaunched run and a
fit() again after an exception end on the uninterrupted run's weights. Those generators cost
tens of microseconds to copy, so they are copied once an epoch and when a checkpoint is
written, never at every step: counted here by the calls to random.getstate."""
from __future__ import annotations

import random

import numpy
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from hookloop.callbacks import Checkpoint
import hookloop.engine.rng

from builders import Crash, RaiseAtBatch, net_loop, same_weights, weights

EPOCHS = 3


class HostNoise(Dataset):
    """24 samples of 4 features; each read adds noise from Python's and NumPy's generators."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int):
        noise = torch.tensor([random.gauss(0.0, 0.1) for _ in range(4)]) \
            + torch.from_numpy(numpy.random.normal(0.0, 0.1, 4)).float()
        return self.x[index] + noise, self.y[index]


def data() -> DataLoader:
    return DataLoader(HostNoise(), batch_size=4, shuffle=True,
                      generator=torch.Generator().manual_seed(7))


def seed_host(value: int) -> None:
    random.seed(value)
    numpy.random.seed(value)


def uninterrupted(host_seed: int = 0) -> dict[str, torch.Tensor]:
    seed_host(host_seed)
    loop = net_loop(train=data(), sanity_val_batches=0)
    loop.fit(EPOCHS)
    return weights(loop)


def test_the_host_draws_change_the_weights() -> None:
    """The oracle can tell: other Python/NumPy draws give other weights."""
    assert not same_weights(uninterrupted(0), uninterrupted(1))


@pytest.mark.parametrize("every_n_steps", [1, 4])
def test_killed_then_relaunched_ends_on_the_uninterrupted_weights(tmp_path, every_n_steps) -> None:
    expected = uninterrupted()
    seed_host(0)
    first = net_loop([Checkpoint(tmp_path, every_n_steps=every_n_steps, keep_last=2),
                      RaiseAtBatch(1, 3, Crash)], train=data(), sanity_val_batches=0)
    with pytest.raises(Crash):  # stands for the kill: nothing after it runs
        first.fit(EPOCHS)
    seed_host(12345)  # a new process: its generators start elsewhere
    resumed = net_loop([Checkpoint(tmp_path, every_n_steps=every_n_steps, resume=True)],
                       train=data(), sanity_val_batches=0)
    resumed.fit(EPOCHS)
    assert resumed.state.step == 6 * EPOCHS
    assert same_weights(resumed, expected)


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_fit_again_after_an_exception_ends_on_the_uninterrupted_weights(
        tmp_path, with_checkpoint) -> None:
    expected = uninterrupted()
    seed_host(0)
    callbacks = [Checkpoint(tmp_path)] if with_checkpoint else []
    loop = net_loop([*callbacks, RaiseAtBatch(1, 4, KeyboardInterrupt)], train=data(),
                    sanity_val_batches=0)
    with pytest.raises(KeyboardInterrupt):
        loop.fit(EPOCHS)
    loop.fit(EPOCHS)
    assert same_weights(loop, expected)


def test_python_and_numpy_generators_are_not_copied_at_every_step(tmp_path, monkeypatch) -> None:
    calls = []
    real = random.getstate
    monkeypatch.setattr(hookloop.engine.rng.random, "getstate", lambda: calls.append(1) or real())
    seed_host(0)
    loop = net_loop([Checkpoint(tmp_path)], train=data(), sanity_val_batches=0)
    loop.fit(EPOCHS)
    assert loop.state.step == 18
    # one at fit start (a check that leaves the generators as found), one at each epoch
    # start, one for each epoch's file: 7, against 18 steps
    assert 1 <= len(calls) <= 1 + 2 * EPOCHS


@pytest.mark.parametrize("monitor", [None, "val_loss"])
def test_validation_data_drawing_too_resumes_exactly(tmp_path, monitor) -> None:
    """Step validations whose data draw from the same generators: a file written before
    the validation (every_n_steps) or during it (the monitored best, at its end) resumes
    to the uninterrupted weights (the resumed run validates again where the file was
    written during a validation, and draws again what it drew)."""
    def run(callbacks):
        return net_loop(callbacks, train=data(), val=DataLoader(HostNoise(), batch_size=8),
                        val_every_n_steps=3, sanity_val_batches=0)

    seed_host(0)
    reference = run([])
    reference.fit(EPOCHS)
    checkpoint = dict(every_n_steps=3, every_n_epochs=None) if monitor is None else \
        dict(monitor=monitor, save_top_k=None, every_n_epochs=None, keep_last=None)
    seed_host(0)
    first = run([Checkpoint(tmp_path, **checkpoint), RaiseAtBatch(1, 5, Crash)])
    with pytest.raises(Crash):
        first.fit(EPOCHS)
    seed_host(12345)
    resumed = run([Checkpoint(tmp_path, **checkpoint, resume=True)])
    resumed.fit(EPOCHS)
    assert same_weights(resumed, reference)
