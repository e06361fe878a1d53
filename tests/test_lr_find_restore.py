"""lr_find must leave the model exactly as it was (docstring: weights, buffers, mode)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hookloop
from hookloop import Loop


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


def make():
    torch.manual_seed(0)
    model = Counting()
    data = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(3)]
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=F.mse_loss, device="cpu")


def test_non_persistent_buffers_are_restored() -> None:
    loop = make()
    before = loop.model.seen.clone()
    hookloop.lr_find(loop, start_lr=1e-4, end_lr=1e-2, steps=5)
    assert torch.equal(loop.model.seen, before)  # fails: 40.0 != 0.0


def test_each_submodule_keeps_its_train_eval_mode() -> None:
    loop = make()
    loop.model.train()
    loop.model.bn.eval()          # a frozen BatchNorm, the fine-tuning pattern
    hookloop.lr_find(loop, start_lr=1e-4, end_lr=1e-2, steps=5)
    assert loop.model.training
    assert not loop.model.bn.training   # fails: lr_find set the whole tree to train
