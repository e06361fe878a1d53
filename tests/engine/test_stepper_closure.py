"""A closure optimizer (torch.optim.LBFGS) through the loop, against a hand-written closure
loop in the style of pytorch/examples' time_sequence_prediction: bit-identical weights."""

from __future__ import annotations

import math

import pytest

import torch
from torch import nn

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import AMP, GradAccumulation

from builders import EventRecorder


class Sequence(nn.Module):
    """A small LSTM cell unrolled over a sine wave, as time_sequence_prediction's."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(1, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(inputs.size(0), 8, dtype=inputs.dtype)
        c = torch.zeros(inputs.size(0), 8, dtype=inputs.dtype)
        outputs = []
        for value in inputs.split(1, dim=1):
            h, c = self.cell(value, (h, c))
            outputs.append(self.head(h))
        return torch.cat(outputs, dim=1)


def waves() -> tuple[torch.Tensor, torch.Tensor]:
    steps = torch.arange(0, 21, dtype=torch.float64)
    shifts = torch.arange(0, 6, dtype=torch.float64).unsqueeze(1) * 3
    data = torch.sin((steps + shifts) / 20 * 2 * math.pi)
    return data[:, :-1].float(), data[:, 1:].float()


def build() -> tuple[nn.Module, torch.optim.LBFGS]:
    torch.manual_seed(0)
    model = Sequence()
    return model, torch.optim.LBFGS(model.parameters(), lr=0.8, max_iter=5)


def hand_loop(epochs: int) -> tuple[nn.Module, list[float]]:
    model, optimizer = build()
    inputs, targets = waves()
    criterion = nn.MSELoss()
    losses = []
    for _ in range(epochs):
        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = criterion(model(inputs), targets)
            loss.backward()
            return loss
        losses.append(float(optimizer.step(closure).detach()))
    return model, losses


class Counts(Callback):
    def __init__(self) -> None:
        self.forwards = 0
        self.losses: list[float] = []

    def after_forward(self, loop: Loop) -> None:
        self.forwards += 1

    def on_batch_end(self, loop: Loop) -> None:
        self.losses.append(float(loop.state.loss.detach()))


def test_lbfgs_through_the_loop_equals_a_hand_written_closure_loop() -> None:
    epochs = 3
    hand, hand_losses = hand_loop(epochs)
    model, optimizer = build()
    recorder, counts = EventRecorder(), Counts()
    loop = Loop(model, optimizer, [waves()], loss_fn=nn.MSELoss(), device="cpu",
                callbacks=[recorder, counts])
    state = loop.fit(epochs)
    for p, q in zip(model.parameters(), hand.parameters()):
        assert torch.equal(p, q)
    assert state.step == epochs
    # The batch's own loss (the closure's first value) is the state's after the step.
    assert counts.losses == hand_losses
    # Each recomputation (up to max_iter - 1 per step) emits after_forward, nothing else.
    names = recorder.labels()
    assert names.count("on_batch_start") == names.count("after_backward") == epochs
    assert names.count("after_forward") == counts.forwards
    assert epochs < counts.forwards <= epochs * 5


@pytest.mark.parametrize("case", ["amp", "accumulation", "two processes"])
def test_a_closure_optimizer_where_the_closure_cannot_be_right_is_refused_before_its_step(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AMP's GradScaler steps without a closure (torch's raw TypeError before); under
    accumulation the closure could re-evaluate only the window's last batch; on several
    ranks the line searches would make different numbers of all-reduces and hang."""
    model, optimizer = build()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    # float16: a GradScaler routes the step (bfloat16 has none: the loop steps, next test).
    callbacks = {"amp": [AMP(torch.float16)], "accumulation": [GradAccumulation(2)],
                 "two processes": []}[case]
    if case == "two processes":
        monkeypatch.setattr("hookloop.engine.stepper.world_size", lambda: 2)
    inputs, targets = waves()
    loop = Loop(model, optimizer, [(inputs, targets)] * 2, loss_fn=nn.functional.mse_loss,
                device="cpu", callbacks=callbacks)
    expected = {"amp": r"AMP routes the optimizer step.*leave AMP out",
                "accumulation": r"accumulates 2 batches.*leave GradAccumulation out",
                "two processes": r"2 processes train.*in one process"}[case]
    with pytest.raises(ConfigurationError, match=r"LBFGS\.step needs a closure.*" + expected):
        loop.fit(1)
    assert all(torch.equal(old, new) for old, new in zip(before, model.parameters()))


def test_bfloat16_amp_leaves_a_closure_optimizer_to_the_loop_under_its_autocast() -> None:
    """Without a GradScaler AMP routes no step (issue 38): the loop gives LBFGS its closure,
    recomputed under AMP's autocast, the same weights as an autocast callback's."""
    class Autocast(Callback):
        def forward_context(self, loop: Loop):
            return torch.autocast("cpu", dtype=torch.bfloat16)

    trained = []
    for callbacks in ([AMP(torch.bfloat16)], [Autocast()]):
        model, optimizer = build()
        inputs, targets = waves()
        Loop(model, optimizer, [(inputs, targets)] * 2, loss_fn=nn.functional.mse_loss,
             device="cpu", callbacks=callbacks).fit(1)
        trained.append([parameter.detach().clone() for parameter in model.parameters()])
    first, second = trained
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    model, _ = build()
    assert not all(torch.equal(a, b) for a, b in zip(first, model.parameters()))  # it trained


class ClosureRouter(Callback):
    """Routes the step as a port of a hand-written LBFGS loop does: its own closure."""

    def optimizer_step(self, loop: Loop) -> None:
        inputs, targets = loop.state.batch

        def closure() -> torch.Tensor:
            loop.optimizer.zero_grad()
            loss = nn.MSELoss()(loop.model(inputs), targets)
            loss.backward()
            return loss

        loop.optimizer.step(closure)


def test_a_router_passing_its_own_closure_trains_as_the_hand_written_closure_loop() -> None:
    """The router's closure is the one LBFGS evaluates (it was refused at the first step,
    "calls step() without one"); the loop's step hook counts each step."""
    epochs = 3
    hand, _ = hand_loop(epochs)
    model, optimizer = build()
    loop = Loop(model, optimizer, [waves()], loss_fn=nn.MSELoss(), device="cpu",
                callbacks=[ClosureRouter()])
    state = loop.fit(epochs)
    for p, q in zip(model.parameters(), hand.parameters()):
        assert torch.equal(p, q)
    assert state.step == epochs
    assert "step" not in vars(optimizer)  # the watch on the router's call is gone


class BareRouter(Callback):
    def optimizer_step(self, loop: Loop) -> None:
        loop.optimizer.step()


def test_a_router_calling_step_without_a_closure_is_refused_with_that_reason() -> None:
    model, optimizer = build()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    loop = Loop(model, optimizer, [waves()], loss_fn=nn.MSELoss(), device="cpu",
                callbacks=[BareRouter()])
    with pytest.raises(ConfigurationError, match=r"LBFGS\.step needs a closure.*BareRouter "
                       r"routes the optimizer step and calls LBFGS\.step\(\) without one\. "
                       r"Pass one from BareRouter\.optimizer_step"):
        loop.fit(1)
    assert all(torch.equal(old, new) for old, new in zip(before, model.parameters()))
    assert "step" not in vars(optimizer)
