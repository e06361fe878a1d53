"""A callback may set ``loop.state.step_boundary`` (issue 16, item 16): in ``on_batch_start``
(before forward: ``train_step_context`` hooks, DDP's ``no_sync``, see it) or in
``after_backward`` (before the step), and the loop steps there.

The oracle is the loop of transformers' run_glue_no_trainer (before accelerate's
``accumulate``): ``loss / k`` every batch, and a step when
``step % k == 0 or step == len(loader) - 1``, an off-by-one window no built-in offers. A
stop and a resume at such a boundary: tests/across_launches/
test_stop_and_resume_at_a_boundary_a_callback_drew.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from builders import DrawnBoundary, regression_batches, sgd, two_layers, weights
from hookloop import Callback, Loop

K, BATCHES = 3, 10


def glue_condition(batch_idx: int) -> bool:
    return batch_idx % K == 0 or batch_idx == BATCHES - 1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return two_layers(4, 8, 1, nn.Tanh(), nn.Dropout(0.1))


def make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return regression_batches(BATCHES, size=5, features=4, seed=3)


def hand_loop(epochs: int) -> tuple[nn.Module, int]:
    model, data = make_model(), make_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)  # dropout's draws, as the loop below gets them
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


def make_loop(*callbacks: Callback) -> Loop:
    model = make_model()
    loop = Loop(model, sgd(0.1, momentum=0.9)(model.parameters()), make_data(),
                loss_fn=F.mse_loss, device="cpu", callbacks=list(callbacks))
    torch.manual_seed(1)
    return loop


@pytest.mark.parametrize("at", ["on_batch_start", "after_backward"])
def test_a_callback_draws_the_step_boundary_and_the_loop_steps_there(at: str) -> None:
    hand, hand_steps = hand_loop(epochs=2)
    glue = DrawnBoundary(glue_condition, at=at, divide_by=K)
    loop = make_loop(glue)
    state = loop.fit(2)
    assert state.step == hand_steps == 2 * 4  # after batches 0, 3, 6 and 9 of each epoch
    assert glue.steps_at == [0, 3, 6, 9] * 2
    assert all(torch.equal(value, weights(hand)[key]) for key, value in weights(loop).items())


class SeesTheBoundary(Callback):
    """What a train_step_context hook (DDP's no_sync) reads when it is entered."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    @contextmanager
    def _nothing(self) -> Iterator[None]:
        yield

    def train_step_context(self, loop: Loop) -> AbstractContextManager[None]:
        self.seen.append(loop.state.step_boundary)
        return self._nothing()


def test_set_in_on_batch_start_it_is_seen_by_the_train_step_contexts() -> None:
    seen = SeesTheBoundary()
    make_loop(DrawnBoundary(glue_condition, divide_by=K), seen).fit(1)
    assert seen.seen == [glue_condition(batch) for batch in range(BATCHES)]
