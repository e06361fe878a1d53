"""The reported epoch losses equal a script's own per-sample average, for mean- and
sum-reduced losses (``Loop(loss_reduction=...)``; ``"auto"`` reads ``loss_fn.reduction``)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import ConfigurationError, Loop


def batches(sizes: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, generator=generator), torch.randn(n, 2, generator=generator))
            for n in sizes]


def summed(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A VAE-style loss: the sum over the batch's samples."""
    return F.mse_loss(outputs, targets, reduction="sum")


def script_average(model: nn.Module, data: list, loss_fn) -> float:  # noqa: ANN001
    """The script's own number: the total of the batch losses over the samples (a mean loss
    is first made a sum by its batch size), as pytorch/examples' vae test() computes it."""
    total = 0.0
    with torch.no_grad():
        for inputs, targets in data:
            loss = loss_fn(model(inputs), targets).item()
            is_sum = loss_fn in (summed, SUMMED_PARTIAL) or getattr(loss_fn, "reduction",
                                                                     "") == "sum"
            total += loss if is_sum else loss * len(inputs)
    return total / sum(len(inputs) for inputs, _ in data)


SUMMED_PARTIAL = functools.partial(F.mse_loss, reduction="sum")


@pytest.mark.parametrize("loss_fn, reduction", [
    (summed, "sum"), (nn.MSELoss(reduction="sum"), "auto"), (SUMMED_PARTIAL, "auto"),
    (F.mse_loss, "auto"), (nn.MSELoss(), "mean")],
    ids=["fn-sum", "module-sum-auto", "partial-sum-auto", "fn-mean", "module-mean"])
def test_val_loss_and_evaluate_equal_the_scripts_own_average(loss_fn, reduction: str) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    train, val = batches([4, 4, 3], seed=1), batches([5, 5, 2], seed=2)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), train, val_data=val,
                loss_fn=loss_fn, device="cpu", loss_reduction=reduction)
    state = loop.fit(1)
    assert loop.loss_reduction == ("mean" if loss_fn in (F.mse_loss,) or reduction == "mean"
                                   else "sum")
    expected = script_average(model, val, loss_fn)
    assert state.metrics["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert loop.evaluate(train, prefix="test")["test_loss"] == pytest.approx(
        script_average(model, train, loss_fn), rel=1e-6)


def test_train_loss_of_a_sum_reduced_loss_is_per_sample() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    train = batches([4, 4, 3], seed=1)
    hand = nn.Linear(3, 2)
    hand.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.01)
    total = 0.0
    for inputs, targets in train:  # the script's training loop and its epoch average
        loss = summed(hand(inputs), targets)
        total += loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), train, loss_fn=summed,
                 device="cpu", loss_reduction="sum").fit(1)
    assert state.metrics["train_loss"] == pytest.approx(total / 11, rel=1e-6)


def test_bad_loss_reductions_are_refused_with_the_fix() -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ConfigurationError, match="loss_reduction"):
        Loop(model, optimizer, batches([2], 0), loss_fn=summed, loss_reduction="total")
    with pytest.raises(ConfigurationError, match="reduction='mean'"):
        Loop(model, optimizer, batches([2], 0), loss_fn=nn.MSELoss(reduction="none"))
