"""loss_fn and forward are checked against how the loop calls them, when the Loop is built
(issue 16 item 8: a one-argument loss_fn gave a raw TypeError at the first batch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hookloop import ConfigurationError, Loop


def _loop(**options) -> Loop:
    model = torch.nn.Linear(2, 1)
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                [(torch.ones(1, 2), torch.ones(1, 1))], device="cpu", **options)


def test_a_one_argument_loss_fn_is_refused_when_the_loop_is_built() -> None:
    def mean_output(outputs):
        return outputs.mean()

    with pytest.raises(ConfigurationError, match=r"loss_fn is called as loss_fn\(outputs, "
                       r"targets\), with 2 arguments, but .*mean_output\(outputs\) cannot take "
                       r"them.*forward=fn\(loop, batch\)"):
        _loop(loss_fn=mean_output)


def test_a_one_argument_forward_is_refused_when_the_loop_is_built() -> None:
    with pytest.raises(ConfigurationError, match=r"forward is called as forward\(loop, batch\)"):
        _loop(forward=lambda batch: (batch, batch))


@pytest.mark.parametrize("loss_fn", [F.mse_loss, torch.nn.MSELoss(),
                                     lambda outputs, targets, weight=1.0: weight,
                                     lambda *tensors: tensors[0]],
                         ids=["function", "module", "defaults", "varargs"])
def test_losses_that_take_two_arguments_are_accepted(loss_fn) -> None:
    _loop(loss_fn=loss_fn)
