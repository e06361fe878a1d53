"""GradAccumulation(last_window=...): the three ways real loops treat an epoch's last,
partial window, each against the hand-written loop that does it (torch.equal on CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import GradAccumulation, LRScheduler

BATCHES, K, EPOCHS = 10, 4, 2  # windows {0..3}, {4..7}, {8, 9}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1))


def make_data(batches: int = BATCHES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator))
            for _ in range(batches)]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


class Stream:
    """Data without a length."""

    def __init__(self, batches: list) -> None:  # noqa: ANN001
        self.batches = batches

    def __iter__(self) -> Iterator:
        return iter(self.batches)


def hand_loop(last_window: str, data: list, epochs: int = EPOCHS) -> tuple[nn.Module, int]:
    """The three hand-written loops, as their scripts write them."""
    model = make_model()
    optimizer = make_optimizer(model)
    torch.manual_seed(1)  # dropout draws, as the loop below gets them
    steps = 0
    for _ in range(epochs):
        model.train()
        if last_window == "drop":
            optimizer.zero_grad(set_to_none=True)  # what the last window left is dropped
        for index, (inputs, labels) in enumerate(data):
            loss = F.mse_loss(model(inputs), labels)
            if last_window == "mean":  # timm: the last window divides by its own size
                start = index - index % K
                divisor = min(K, len(data) - start)
            else:  # loss / accumulation_steps, always
                divisor = K
            (loss / divisor).backward()
            ends_window = (index + 1) % K == 0
            if ends_window or (last_window != "drop" and index == len(data) - 1):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps += 1
    return model, steps


class CountSteps(Callback):
    def __init__(self) -> None:
        self.at: list[tuple[int, int]] = []

    def after_step(self, loop: Loop) -> None:
        self.at.append((loop.state.epoch, loop.state.batch_idx))


def hook_loop(last_window: str, data: object, epochs: int = EPOCHS
              ) -> tuple[nn.Module, Loop, CountSteps]:
    model = make_model()
    steps = CountSteps()
    loop = Loop(model, make_optimizer(model), data, loss_fn=F.mse_loss, device="cpu",
                callbacks=[GradAccumulation(K, last_window=last_window), steps])
    torch.manual_seed(1)
    loop.fit(epochs)
    return model, loop, steps


def assert_equal_weights(model: nn.Module, hand: nn.Module) -> None:
    for (name, value), expected in zip(model.state_dict().items(), hand.state_dict().values()):
        assert torch.equal(value, expected), name


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
@pytest.mark.parametrize("last_window", ["mean", "as_full", "drop"])
def test_each_last_window_equals_its_hand_loop(last_window: str, sized: bool) -> None:
    data = make_data()
    hand, hand_steps = hand_loop(last_window, data)
    model, loop, steps = hook_loop(last_window, data if sized else Stream(data))
    assert loop.state.step == hand_steps
    assert_equal_weights(model, hand)
    per_epoch = [(0, 3), (0, 7), (0, 9)] if last_window != "drop" else [(0, 3), (0, 7)]
    assert steps.at == per_epoch + [(1, batch) for _, batch in per_epoch]


def test_the_three_differ() -> None:
    """The oracle discriminates: each option trains other weights."""
    data = make_data()
    weights = [hand_loop(option, data)[0][0].weight for option in ("mean", "as_full", "drop")]
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])


def test_drop_counts_only_whole_windows_for_the_schedule() -> None:
    data = make_data()
    totals: list[int] = []

    def factory(optimizer: torch.optim.Optimizer, total: int
                ) -> torch.optim.lr_scheduler.LRScheduler:
        totals.append(total)
        return torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=total)

    model = make_model()
    loop = Loop(model, make_optimizer(model), data, loss_fn=F.mse_loss, device="cpu",
                callbacks=[GradAccumulation(K, last_window="drop"), LRScheduler(factory)])
    loop.fit(EPOCHS)
    assert loop.steps_per_epoch == BATCHES // K == 2
    assert totals == [EPOCHS * 2] and loop.state.step == EPOCHS * 2
    assert loop.optimizer.param_groups[0]["lr"] == 0.0  # the schedule ran to its end, exactly


def test_drop_leaves_no_gradient_and_an_epoch_shorter_than_a_window_makes_no_step() -> None:
    model = make_model()
    loop = Loop(model, make_optimizer(model), make_data(3), loss_fn=F.mse_loss, device="cpu",
                callbacks=[GradAccumulation(K, last_window="drop")])
    before = [param.detach().clone() for param in model.parameters()]
    assert loop.fit(2).step == 0
    assert all(param.grad is None for param in model.parameters())
    assert all(torch.equal(param, old) for param, old in zip(model.parameters(), before))


def test_removing_drop_restores_the_geometry() -> None:
    model = make_model()
    loop = Loop(model, make_optimizer(model), make_data(), loss_fn=F.mse_loss, device="cpu",
                callbacks=[GradAccumulation(K, last_window="drop")])
    loop.fit(1)
    assert loop.steps_per_epoch == 2
    loop.callbacks = [GradAccumulation(K)]
    loop.fit(2)
    assert loop.steps_per_epoch == 3 and loop.state.step == 2 + 3


def test_a_bad_last_window_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="GradAccumulation last_window must be one of "
                                                 "'mean', 'as_full', 'drop', got 'sum'"):
        GradAccumulation(4, last_window="sum")
    assert repr(GradAccumulation(4, last_window="as_full")) == \
        "GradAccumulation(4, last_window='as_full')"
    assert repr(GradAccumulation(4)) == "GradAccumulation(4)"
