"""GradClip clips in the model's parameter order (issue 16, item 4): with param groups that
list the parameters in another order (weight decay off for biases, on for weights), the
clipped gradients and the reported norm are bit for bit those of a hand-written
``clip_grad_norm_(model.parameters(), max_norm)``."""

from __future__ import annotations

import copy

import torch
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import GradClip
from hookloop.engine.grads import parameters_in_model_order

MAX_NORM = 0.1


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])


def _groups(model: nn.Module) -> list[dict[str, object]]:
    """Biases (no weight decay) first and last-to-first, then the weights: an order unlike
    the model's, as weight-decay groups are built in real scripts."""
    weights = [param for name, param in model.named_parameters() if name.endswith("weight")]
    biases = [param for name, param in model.named_parameters() if name.endswith("bias")]
    return [{"params": biases[::-1], "weight_decay": 0.0},
            {"params": weights, "weight_decay": 0.01}]


class ClippedGrads(Callback):
    """The gradients as the optimizer step sees them (after GradClip), by parameter name."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.norm: torch.Tensor | None = None

    def before_step(self, loop: Loop) -> None:
        self.grads = {name: param.grad.clone()
                      for name, param in loop.unwrapped_model.named_parameters()}
        self.norm = loop.state.grad_norm.clone()


def test_clipped_gradients_equal_clip_grad_norm_over_model_parameters() -> None:
    model = _model()
    hand = copy.deepcopy(model)
    torch.manual_seed(14)  # a batch whose norm summed in group order differs in its last bit
    batch = (torch.randn(32, 16) * 3, torch.randn(32, 16))
    recorder = ClippedGrads()
    loop = Loop(model, torch.optim.SGD(_groups(model), lr=0.1), [batch],
                loss_fn=nn.functional.mse_loss, device="cpu", sanity_val_batches=0,
                callbacks=[GradClip(MAX_NORM), recorder])
    loop.fit(1)

    # The oracle: what a user writes by hand.
    nn.functional.mse_loss(hand(batch[0]), batch[1]).backward()
    norm = torch.nn.utils.clip_grad_norm_(hand.parameters(), MAX_NORM)
    assert norm > MAX_NORM  # clipping is active
    assert torch.equal(recorder.norm, norm)
    for name, param in hand.named_parameters():
        assert torch.equal(recorder.grads[name], param.grad), name


def test_parameters_outside_the_model_come_after_in_group_order() -> None:
    model = _model()
    extra = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
    groups = _groups(model)
    groups[0]["params"] = [extra[1], *groups[0]["params"]]  # type: ignore[misc]
    groups[1]["params"] = [*groups[1]["params"], extra[0]]  # type: ignore[misc]
    ordered = parameters_in_model_order(model, torch.optim.SGD(groups, lr=0.1))
    assert [id(param) for param in ordered] == (
        [id(param) for param in model.parameters()] + [id(extra[1]), id(extra[0])])
