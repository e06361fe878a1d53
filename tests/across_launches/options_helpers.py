from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from hookloop import Callback, Loop


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def make_data(n_batches: int = 4, batch: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, generator=g), torch.randn(batch, 1, generator=g))
            for _ in range(n_batches)]


class Score(Callback):
    """A scripted val metric per validation index."""

    def __init__(self, values):
        self.values = list(values)
        self.count = 0

    def produces(self, loop):
        return ["val_score"]

    def on_validation_end(self, loop):
        if loop.sanity_checking:
            loop.state.metrics["val_score"] = 0.0
            return
        loop.state.metrics["val_score"] = self.values[len(loop.state.history)]


class Snapshot(Callback):
    """Copies the checkpoint directory at the end of an epoch: a kill right after it."""

    def __init__(self, src, dst, epoch):
        self.src, self.dst, self.epoch = src, dst, epoch

    def on_epoch_end(self, loop):
        if loop.state.epoch == self.epoch and not os.path.exists(self.dst):
            shutil.copytree(self.src, self.dst)


def make_loop(callbacks=(), *, val=True, lr=0.05, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return Loop(model, opt, make_data(), val_data=make_data(2, seed=7) if val else None,
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=list(callbacks),
                **kwargs)


def weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
