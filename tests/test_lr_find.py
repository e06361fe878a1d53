"""hookloop.lr_find: the rates tried, the smoothing, the stop, and nothing left changed."""

from __future__ import annotations

import math
import random

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from hookloop import Callback, ConfigurationError, Loop
import hookloop

from builders import adam, shuffled, two_layers
from builders import make_loop as build_loop


def summing(samples: int) -> TensorDataset:
    """Inputs from the global generator; each target is the sum of its input's features."""
    inputs = torch.randn(samples, 4)
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))


def make_loop(lr: float = 0.05, callbacks: list[Callback] | None = None) -> Loop:
    return build_loop(callbacks or [],
                      model=lambda: two_layers(4, 16, 1, nn.BatchNorm1d(16), nn.ReLU(),
                                               nn.Dropout(0.2)),
                      train=lambda: shuffled(summing(48), 8, seed=5), optimizer=adam(lr))


def test_rates_are_the_exponential_ramp() -> None:
    loop = make_loop()
    result = hookloop.lr_find(loop, start_lr=1e-6, end_lr=1e-1, steps=11)
    assert len(result.lrs) == 11  # 6 batches per pass: the data was started over
    expected = [1e-6 * (1e5) ** (i / 10) for i in range(11)]
    assert result.lrs == pytest.approx(expected, rel=1e-12)
    assert result.lrs[0] == pytest.approx(1e-6) and result.lrs[-1] == pytest.approx(1e-1)


def test_smoothed_losses_are_bias_corrected_averages() -> None:
    result = hookloop.lr_find(make_loop(), start_lr=1e-5, end_lr=1e-2, steps=8, smoothing=0.9)
    average = 0.0
    for index, (raw, smoothed) in enumerate(zip(result.raw_losses, result.losses)):
        average = 0.9 * average + 0.1 * raw
        assert smoothed == pytest.approx(average / (1 - 0.9 ** (index + 1)), rel=1e-12)
    assert result.losses[0] == pytest.approx(result.raw_losses[0])  # bias-corrected start


def test_the_same_losses_as_a_hand_written_ramp() -> None:
    """The weights really train at each rate: a hand loop over the same batches agrees."""
    loop = make_loop()
    rng = torch.get_rng_state()  # dropout draws from it
    result = hookloop.lr_find(loop, start_lr=1e-4, end_lr=1.0, steps=6, smoothing=0.0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(16, 1))
    model.load_state_dict(loop.model.state_dict())  # lr_find left these weights unchanged
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    torch.set_rng_state(rng)
    raw = []
    for index, (inputs, targets) in enumerate(loop.train_data):  # same generator state: same order
        for group in optimizer.param_groups:
            group["lr"] = 1e-4 * (1e4) ** (index / 5)
        loss = F.mse_loss(model(inputs), targets)
        raw.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert result.raw_losses == pytest.approx(raw, rel=1e-5)
    assert result.losses == result.raw_losses  # smoothing=0: no smoothing


def test_stops_at_divergence_and_suggests_from_the_descent() -> None:
    result = hookloop.lr_find(make_loop(), start_lr=1e-5, end_lr=1e3, steps=100)
    assert len(result.lrs) < 100 and result.stop_reason is not None
    best = min(result.losses)
    assert result.losses[-1] > 4 * best or not math.isfinite(result.raw_losses[-1])
    assert all(value <= 4 * min(result.losses[: i + 1])
               for i, value in enumerate(result.losses[:-1]))
    assert result.suggestion is not None and 1e-5 < result.suggestion < result.lrs[-1]
    # The suggestion is the steepest descent of the smoothed curve (before the last point).
    # Left out: the first fifth of the points (at most 10) and the diverging last point.
    begin = min(10, (len(result.lrs) - 1) // 5)
    lrs, losses = result.lrs[begin:-1], result.losses[begin:-1]
    logs = [math.log(lr) for lr in lrs]
    slopes = [(losses[min(i + 1, len(losses) - 1)] - losses[max(i - 1, 0)]) /
              (logs[min(i + 1, len(losses) - 1)] - logs[max(i - 1, 0)]) for i in range(len(losses))]
    assert result.suggestion == lrs[slopes.index(min(slopes))]
    table = result.table()
    assert "<- suggestion" in table and "smoothed loss" in table


def test_a_non_finite_loss_stops_without_recording_it() -> None:
    calls = {"n": 0}

    def forward(loop: Loop, batch: object) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch  # type: ignore[misc]
        outputs = loop.model(inputs)
        calls["n"] += 1
        loss = F.mse_loss(outputs, targets)
        return outputs, loss * (math.inf if calls["n"] == 4 else 1.0)

    loop = make_loop()
    loop.forward = forward
    result = hookloop.lr_find(loop, steps=10)
    assert len(result.lrs) == 3 and "inf" in (result.stop_reason or "")


def test_model_optimizer_and_every_rng_are_left_exactly_as_they_were() -> None:
    loop = make_loop()
    loop.fit(1)  # an optimizer with state (Adam moments), a model with BN statistics
    loop.model.eval()
    model_before = {k: v.clone() for k, v in loop.model.state_dict().items()}
    optimizer_before = loop.optimizer.state_dict()
    moments_before = {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)}
                      for k, v in optimizer_before["state"].items()}
    groups_before = [dict(g) for g in optimizer_before["param_groups"]]
    random.seed(1)
    numpy.random.seed(2)
    torch.manual_seed(3)
    loader_state = loop.train_data.generator.get_state()
    python_state, numpy_state, torch_state = random.getstate(), numpy.random.get_state(), \
        torch.get_rng_state()
    history = list(loop.state.history)

    hookloop.lr_find(loop, steps=20)

    for name, value in loop.model.state_dict().items():
        assert torch.equal(value, model_before[name]), name
    assert not loop.model.training
    after = loop.optimizer.state_dict()
    assert after["param_groups"] == groups_before
    for key, tensors in moments_before.items():
        for name, tensor in tensors.items():
            assert torch.equal(after["state"][key][name], tensor)
    assert random.getstate() == python_state
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert torch.equal(loop.train_data.generator.get_state(), loader_state)
    restored = numpy.random.get_state()
    assert restored[0] == numpy_state[0] and (restored[1] == numpy_state[1]).all() \
        and restored[2:] == numpy_state[2:]
    assert all(p.grad is None for p in loop.model.parameters())
    assert loop.state.history == history


def test_a_later_fit_is_the_same_as_without_lr_find() -> None:
    plain = make_loop()
    plain.fit(2)
    tested = make_loop()
    hookloop.lr_find(tested, steps=15)
    tested.fit(2)
    for (name, value), other in zip(plain.model.state_dict().items(),
                                    tested.model.state_dict().values()):
        assert torch.equal(value, other), name


def test_callbacks_do_not_run() -> None:
    class Loud(Callback):
        def on_batch_start(self, loop: Loop) -> None:
            raise AssertionError("a callback ran inside lr_find")

    result = hookloop.lr_find(make_loop(callbacks=[Loud()]), steps=5)
    assert len(result.lrs) == 5


@pytest.mark.parametrize("kwargs", [dict(start_lr=0), dict(start_lr=1.0, end_lr=0.1),
                                    dict(steps=1), dict(steps=2.5), dict(smoothing=1.0),
                                    dict(divergence=1.0), dict(end_lr=math.inf)])
def test_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        hookloop.lr_find(make_loop(), **kwargs)  # type: ignore[arg-type]


def test_empty_data_is_a_clear_error() -> None:
    model = nn.Linear(2, 1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], loss_fn=F.mse_loss,
                device="cpu")
    with pytest.raises(ConfigurationError, match="empty"):
        hookloop.lr_find(loop, steps=3)
