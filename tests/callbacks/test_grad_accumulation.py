"""GradAccumulation against a hand-written accumulation loop with a partial last window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, CallbackOrderError, ConfigurationError, Loop
from hookloop.callbacks import GradAccumulation

from builders import Unsized, regression_batches, two_layers


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return two_layers(4, 8, 1, nn.Tanh())


def make_data(batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return regression_batches(batches, size=6, features=4, seed=5)


class Steps(Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []
        self.batches = 0
        self.losses: list[torch.Tensor] = []

    def on_batch_start(self, loop: Loop) -> None:
        self.batches += 1

    def after_forward(self, loop: Loop) -> None:
        self.losses.append(loop.state.loss.detach())

    def after_step(self, loop: Loop) -> None:
        self.steps.append((loop.state.epoch, loop.state.batch_idx))


def test_partial_window_matches_hand_loop() -> None:
    data, k, epochs = make_data(10), 4, 2
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    hand_steps = 0
    for _ in range(epochs):
        for batch_idx, (inputs, labels) in enumerate(data):
            window = 4 if batch_idx < 8 else 2  # windows {0..3}, {4..7}, {8, 9}
            (F.mse_loss(model(inputs), labels) / window).backward()
            if (batch_idx + 1) % k == 0 or batch_idx == len(data) - 1:
                optimizer.step()
                optimizer.zero_grad()
                hand_steps += 1

    hook_model = make_model()
    steps = Steps()
    state = Loop(hook_model, torch.optim.SGD(hook_model.parameters(), lr=0.2, momentum=0.9), data,
                 loss_fn=F.mse_loss, device="cpu", callbacks=[GradAccumulation(k), steps]).fit(epochs)
    assert hand_steps == state.step == 6
    assert steps.steps == [(0, 3), (0, 7), (0, 9), (1, 3), (1, 7), (1, 9)]
    for p, hand in zip(hook_model.parameters(), model.parameters()):
        assert torch.allclose(p, hand, atol=1e-6)
    # The loss the loop reports is the true one, not divided by the window.
    with torch.no_grad():
        first = F.mse_loss(make_model()(data[0][0]), data[0][1])
    assert torch.allclose(steps.losses[0], first)


def test_dividing_the_last_window_by_steps_would_differ() -> None:
    """The oracle above is discriminating: averaging 2 batches is not dividing by 4."""
    data = make_data(10)
    callback = GradAccumulation(4)
    callback._batches = len(data)
    assert [callback.window_size(i) for i in range(10)] == [4] * 8 + [2] * 2


def test_an_epoch_shorter_than_a_window_still_steps() -> None:
    data = make_data(3)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, labels in data:
        (F.mse_loss(model(inputs), labels) / 3).backward()
    optimizer.step()
    hook_model = make_model()
    state = Loop(hook_model, torch.optim.SGD(hook_model.parameters(), lr=0.1), data,
                 loss_fn=F.mse_loss, device="cpu", callbacks=[GradAccumulation(8)]).fit(1)
    assert state.step == 1
    for p, hand in zip(hook_model.parameters(), model.parameters()):
        assert torch.allclose(p, hand, atol=1e-6)


def test_sets_the_loop_geometry() -> None:
    model = make_model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(10),
                loss_fn=F.mse_loss, device="cpu", callbacks=[GradAccumulation(4)])
    loop.fit(0)
    assert loop.accumulation_steps == 4
    assert loop.steps_per_epoch == 3


def test_unsized_data_steps_every_window_and_the_partial_last_one_at_exhaustion() -> None:
    data, k, epochs = make_data(10), 4, 2
    hand_model = make_model()
    optimizer = torch.optim.SGD(hand_model.parameters(), lr=0.2, momentum=0.9)
    for _ in range(epochs):  # windows {0..3}, {4..7}, {8, 9}: the last averages 2 batches
        for batch_idx, (inputs, labels) in enumerate(data):
            window = 4 if batch_idx < 8 else 2
            (F.mse_loss(hand_model(inputs), labels) / window).backward()
            if (batch_idx + 1) % k == 0 or batch_idx == len(data) - 1:
                optimizer.step()
                optimizer.zero_grad()
    steps = Steps()
    model = make_model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), Unsized(data),
                loss_fn=F.mse_loss, device="cpu", callbacks=[GradAccumulation(k), steps])
    state = loop.fit(epochs)
    assert state.step == 6
    assert steps.steps == [(0, 3), (0, 7), (0, 9), (1, 3), (1, 7), (1, 9)]
    for p, hand in zip(model.parameters(), hand_model.parameters()):
        assert torch.allclose(p, hand, atol=1e-6)


def test_removing_gradaccumulation_removes_the_window() -> None:
    data = make_data(8)
    model = make_model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
                device="cpu", callbacks=[GradAccumulation(4)])
    loop.fit(1)
    assert loop.state.step == 2
    steps = Steps()
    loop.callbacks = [steps]
    loop.fit(2)  # the geometry is read afresh: one step per batch, the loss undivided
    assert loop.accumulation_steps == 1 and loop.state.step == 2 + 8
    assert len(steps.steps) == 8


def test_two_instances_are_rejected() -> None:
    steps = Steps()
    model = make_model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(2), loss_fn=F.mse_loss,
                device="cpu", callbacks=[GradAccumulation(2), GradAccumulation(4), steps])
    with pytest.raises(CallbackOrderError, match="GradAccumulation"):
        loop.fit(1)
    assert steps.batches == 0


@pytest.mark.parametrize("steps", [0, -1, 2.0, True])
def test_bad_steps(steps: object) -> None:
    with pytest.raises(ConfigurationError, match=r"GradAccumulation steps must be an int >= 1, got "):
        GradAccumulation(steps)  # type: ignore[arg-type]


def test_stateless() -> None:
    assert GradAccumulation(2).state_dict() == {}


@pytest.mark.parametrize("last_window", ["mean", "as_full", "drop"])
def test_only_drop_is_called_at_every_batch_start(last_window: str) -> None:
    # Without "drop" its on_batch_start does nothing: left out of the fit's table (issue 38).
    model = two_layers(3, 8, 1)
    accumulation = GradAccumulation(2, last_window=last_window)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), regression_batches(5),
                loss_fn=F.mse_loss, callbacks=[accumulation], device="cpu")
    loop.fit(1)
    listed = [handler.__self__ for handler in loop._table.on_batch_start]
    assert listed == ([accumulation] if last_window == "drop" else [])


@pytest.mark.parametrize("last_window", ["mean", "as_full", "drop"])
@pytest.mark.parametrize("sized", [True, False])
def test_after_backward_is_called_only_where_it_can_act(last_window: str, sized: bool) -> None:
    """After a backward it drops a dropped window's gradients ("drop") or rescales a window
    that data without a length cut short ("mean"); otherwise it is left out of the fit's
    table (issue 38), and the weights are those of the same fit with it called."""
    class Called(GradAccumulation):  # its own after_backward: always in the table
        def after_backward(self, loop: Loop) -> None:
            super().after_backward(loop)

    def run(accumulation: GradAccumulation) -> Loop:
        torch.manual_seed(0)
        model = two_layers(3, 8, 1)
        data = regression_batches(5)
        loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    data if sized else Unsized(data), loss_fn=F.mse_loss,
                    callbacks=[accumulation], device="cpu")
        loop.fit(2)
        return loop

    accumulation = GradAccumulation(2, last_window=last_window)
    loop = run(accumulation)
    listed = [handler.__self__ for handler in loop._table.after_backward]
    acts = last_window == "drop" or (last_window == "mean" and not sized)
    assert listed == ([accumulation] if acts else [])
    reference = run(Called(2, last_window=last_window))
    assert [handler.__self__ for handler in reference._table.after_backward] == \
        [reference.callbacks[0]]
    assert all(torch.equal(a, b) for a, b in zip(loop.model.parameters(),
                                                 reference.model.parameters()))
