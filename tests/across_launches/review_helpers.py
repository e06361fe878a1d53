"""Tiny deterministic setups for the across-launch regression tests."""
from __future__ import annotations

import torch
from torch import nn

from hookloop import Loop


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def make_data(n_batches: int = 4, batch: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, generator=g), torch.randn(batch, 1, generator=g))
            for _ in range(n_batches)]


def make_loop(callbacks=(), *, train=None, val=None, lr=0.05, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return Loop(model, opt, train if train is not None else make_data(), val_data=val,
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=list(callbacks),
                **kwargs)


def weights(loop):
    return {k: v.detach().clone() for k, v in loop.unwrapped_model.state_dict().items()}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
