"""torchrun script: DDP(sync_batchnorm=True) with a BatchNorm model.

Usage: torchrun --nproc_per_node=N sync_batchnorm.py OUT_DIR DEVICE sync|plain

On CPU ``sync`` is refused at setup (the test reads the error). On CUDA the model trains
with its BatchNorm layers converted (``sync``) or as they are (``plain``); each rank writes
the layer types it trained with, its final weights and its val_loss to OUT_DIR.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from common import FEATURES, rank, regression_data, save, shuffled_loader
from hookloop import Callback, Loop
from hookloop.callbacks import DDP


def make_bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


class LayerTypes(Callback):
    """The normalisation layers the model trains with, seen at the first batch."""

    def __init__(self) -> None:
        self.types: list[str] = []

    def on_batch_start(self, loop: Loop) -> None:
        if not self.types:
            self.types = [type(layer).__name__ for layer in loop.unwrapped_model.modules()
                          if "BatchNorm" in type(layer).__name__]


if __name__ == "__main__":
    device, mode = sys.argv[2], sys.argv[3]
    model = make_bn_model(seed=1)
    types = LayerTypes()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                shuffled_loader(regression_data(64, seed=2), batch_size=8, seed=3),
                val_data=torch.utils.data.DataLoader(regression_data(32, seed=4), batch_size=8),
                loss_fn=nn.functional.mse_loss, device=device,
                callbacks=[DDP(sync_batchnorm=mode == "sync"), types])
    state = loop.fit(2)
    save("result", {"types": types.types, "val_loss": state.metrics["val_loss"],
                    "rank": rank(), "step": state.step})
    save("weights", {key: value.cpu() for key, value in loop.unwrapped_model.state_dict().items()})
