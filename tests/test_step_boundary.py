"""A callback may set ``loop.state.step_boundary`` (issue 16, item 16): in ``on_batch_start``
(before forward: DDP's ``no_sync`` sees it) or in ``after_backward`` (before the step), and
the loop steps there, counts the position there, and a stop waits for it.

The oracle is the loop of transformers' run_glue_no_trainer (before accelerate's
``accumulate``): ``loss / k`` every batch, and a step when
``step % k == 0 or step == len(loader) - 1``, an off-by-one window no built-in offers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, Loop

K, BATCHES = 3, 10


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 1))


def make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(5, 4, generator=generator), torch.randn(5, 1, generator=generator))
            for _ in range(BATCHES)]


def glue_condition(batch_idx: int) -> bool:
    return batch_idx % K == 0 or batch_idx == BATCHES - 1


def hand_loop(data: list, epochs: int) -> tuple[nn.Module, int]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    steps = 0
    for _ in range(epochs):
        model.train()
        for step, (inputs, labels) in enumerate(data):
            (F.mse_loss(model(inputs), labels) / K).backward()
            if glue_condition(step):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps += 1
    return model, steps


class GlueSteps(Callback):
    """run_glue_no_trainer's step condition, set at ``at`` (an event name)."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.steps_at: list[int] = []

    def scale_loss(self, loop: Loop, loss: torch.Tensor) -> torch.Tensor:
        return loss / K

    def _set(self, loop: Loop) -> None:
        loop.state.step_boundary = glue_condition(loop.state.batch_idx)

    def on_batch_start(self, loop: Loop) -> None:
        if self.at == "on_batch_start":
            self._set(loop)

    def after_backward(self, loop: Loop) -> None:
        if self.at == "after_backward":
            self._set(loop)

    def after_step(self, loop: Loop) -> None:
        self.steps_at.append(loop.state.batch_idx)


class SeesTheBoundary(Callback):
    """What a train_step_context hook (DDP's no_sync) reads when it is entered."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    @contextmanager
    def _context(self) -> Iterator[None]:
        yield

    def train_step_context(self, loop: Loop):  # noqa: ANN201
        self.seen.append(loop.state.step_boundary)
        return self._context()


def make_loop(*callbacks: Callback, data: list | None = None) -> Loop:
    model = make_model()
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                make_data() if data is None else data, loss_fn=F.mse_loss, device="cpu",
                callbacks=list(callbacks))


@pytest.mark.parametrize("at", ["on_batch_start", "after_backward"])
def test_a_callback_draws_the_step_boundary_and_the_loop_steps_there(at: str) -> None:
    hand, hand_steps = hand_loop(make_data(), epochs=2)
    glue = GlueSteps(at)
    loop = make_loop(glue)
    torch.manual_seed(1)
    state = loop.fit(2)
    assert state.step == hand_steps == 2 * 4  # batches 0, 3, 6 and 9 of each epoch
    assert glue.steps_at == [0, 3, 6, 9] * 2
    for value, expected in zip(loop.model.state_dict().values(), hand.state_dict().values()):
        assert torch.equal(value, expected)


def test_set_in_on_batch_start_it_is_seen_by_the_train_step_contexts() -> None:
    seen = SeesTheBoundary()
    make_loop(GlueSteps("on_batch_start"), seen).fit(1)
    assert seen.seen == [glue_condition(batch) for batch in range(BATCHES)]


class StopAt(Callback):
    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.epoch == 0 and loop.state.batch_idx == self.batch_idx:
            loop.stop("a test stop")


@pytest.mark.parametrize("at", ["on_batch_start", "after_backward"])
def test_a_stop_waits_for_the_boundary_the_callback_drew(at: str) -> None:
    """Stopped at batch 4 (inside the callback's window 4..6, where the loop alone would have
    a boundary after every batch), the loop trains on to batch 6 and steps; a later fit
    continues from batch 7: the same weights as the run without the stop."""
    hand, _ = hand_loop(make_data(), epochs=2)
    glue = GlueSteps(at)
    loop = make_loop(glue, StopAt(4))
    torch.manual_seed(1)
    loop.fit(2)
    assert loop.position == (0, 7, 3) and glue.steps_at == [0, 3, 6]
    loop.fit(2)
    assert loop.state.step == 2 * 4 and glue.steps_at == [0, 3, 6] + [9] + [0, 3, 6, 9]
    for value, expected in zip(loop.model.state_dict().values(), hand.state_dict().values()):
        assert torch.equal(value, expected)


class FailAt(Callback):
    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx
        self.armed = True

    def on_batch_start(self, loop: Loop) -> None:
        if self.armed and loop.state.batch_idx == self.batch_idx:
            self.armed = False
            raise RuntimeError("a test failure")


def mean_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).abs().mean()


@pytest.mark.parametrize("at", ["on_batch_start", "after_backward"])
def test_metrics_training_sums_resume_at_a_boundary_a_callback_drew(at: str) -> None:
    """A run that failed at batch 9 resumes from the boundary after batch 6 (a fresh loop
    loading its state): Metrics' train_mae equals the uninterrupted run's."""
    from hookloop.callbacks import Metrics

    def run(*extra: Callback) -> Loop:
        loop = make_loop(GlueSteps(at), Metrics(mae=mean_error, on_train=True), *extra)
        torch.manual_seed(1)
        return loop

    uninterrupted = run()
    expected = uninterrupted.fit(1).metrics["train_mae"]
    failing = run(FailAt(9))
    with pytest.raises(RuntimeError, match="a test failure"):
        failing.fit(1)
    assert failing.position == (0, 7, 3)
    saved = failing.state_dict()
    assert saved["callbacks"]["Metrics(mae)"]["batch_idx"] == 7  # the sums at that boundary
    resumed = run()
    resumed.load_state_dict(saved)
    assert resumed.fit(1).metrics["train_mae"] == expected
