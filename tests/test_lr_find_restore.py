"""lr_find leaves the model exactly as it was (its docstring: weights, buffers, modes), a
buffer that is not in the state dict and a submodule in eval mode included."""
from __future__ import annotations

import torch
from torch import nn

from hookloop import Loop
import hookloop

from builders import make_loop, regression_batches


class Counting(nn.Module):
    """A model with a non-persistent buffer updated in training (a running counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.bn = nn.BatchNorm1d(1)
        self.register_buffer("seen", torch.zeros(()), persistent=False)

    def forward(self, x):
        if self.training:
            self.seen += x.shape[0]
        return self.bn(self.fc(x))


def make() -> Loop:
    return make_loop(model=Counting, train=lambda: regression_batches(3, size=8))


def test_non_persistent_buffers_are_restored() -> None:
    """A buffer lr_find's trial steps change, outside the state dict, comes back too."""
    loop = make()
    before = loop.model.seen.clone()
    hookloop.lr_find(loop, start_lr=1e-4, end_lr=1e-2, steps=5)
    assert torch.equal(loop.model.seen, before)


def test_each_submodule_keeps_its_train_eval_mode() -> None:
    """A frozen BatchNorm stays in eval mode: lr_find does not set the whole tree to train."""
    loop = make()
    loop.model.train()
    loop.model.bn.eval()          # a frozen BatchNorm, the fine-tuning pattern
    hookloop.lr_find(loop, start_lr=1e-4, end_lr=1e-2, steps=5)
    assert loop.model.training
    assert not loop.model.bn.training
