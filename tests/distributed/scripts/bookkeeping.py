"""torchrun script (2 ranks, gloo): what the loop counts and keeps under torchrun, against
the oracles of tests/distributed/test_bookkeeping_processes.py. One launch, four fits:

1. ``ddp``: a DDP fit recording ``loop.total_steps`` at ``on_fit_start``, at every epoch
   start and at ``on_fit_end`` (after DDP's, which gives the user's unsharded loader back).
2. ``parallel``: TensorParallel with torch's ``loss_parallel``: the head's logits stay
   sharded over the classes (a DTensor), so the loss is a DTensor; a Checkpoint saves every
   epoch.
3. ``plain``: the same fit with the head's logits gathered: a plain loss, the oracle.
4. ``resumed``: the ``parallel`` fit resumed from its epoch-0 checkpoint, to its end.

Usage: torchrun --nproc_per_node=2 bookkeeping.py OUT_DIR
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import out_dir, rank, regression_data, save
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Loop
from hookloop.callbacks import DDP, Checkpoint, TensorParallel

DDP_SAMPLES, DDP_BATCH, DDP_EPOCHS = 96, 4, 2
CLASSES, WIDTH = 6, 8


class TotalSteps(Callback):
    """``loop.total_steps`` wherever a callback may read it to size a schedule."""

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    def on_fit_start(self, loop: Loop) -> None:
        self.seen.append(["on_fit_start", loop.total_steps])

    def on_epoch_start(self, loop: Loop) -> None:
        self.seen.append([f"on_epoch_start {loop.state.epoch}", loop.total_steps])

    def on_fit_end(self, loop: Loop) -> None:
        self.seen.append(["on_fit_end", loop.total_steps])


def ddp_fit() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    data = DataLoader(regression_data(DDP_SAMPLES, seed=1), batch_size=DDP_BATCH)
    recorder = TotalSteps()  # after DDP: its on_fit_end runs after DDP's gave the loader back
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), data, loss_fn=F.mse_loss,
                device="cpu", callbacks=[DDP(), recorder])
    loop.fit(DDP_EPOCHS)
    save("ddp", {"seen": recorder.seen, "steps": loop.state.step})


class LossParallel(Callback):
    """torch's ``loss_parallel`` around forward and backward, and around validation: the
    docs' recipe (docs/callbacks/tensor_parallel.md)."""

    def train_step_context(self, loop: Loop) -> AbstractContextManager[Any]:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def validation_context(self, loop: Loop) -> AbstractContextManager[Any]:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()


class Losses(Callback):
    """Every training batch's loss as the loop keeps it (a host read per batch: a test)."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.kinds: set[str] = set()

    def after_forward(self, loop: Loop) -> None:
        assert loop.state.loss is not None
        self.kinds.add(type(loop.state.loss).__name__)
        self.values.append(loop.state.loss.item())


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.embed(inputs))
        return self.head(hidden + self.down(torch.relu(self.up(hidden))))


def plan(sharded_logits: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    head = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if sharded_logits
            else ColwiseParallel(output_layouts=Replicate()))  # gathered: plain logits
    return {"up": ColwiseParallel(), "down": RowwiseParallel(), "head": head}


def loaders() -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(64, 4, generator=generator)
    labels = torch.randint(0, CLASSES, (64,), generator=generator)
    return (DataLoader(TensorDataset(inputs[:48], labels[:48]), batch_size=8),
            DataLoader(TensorDataset(inputs[48:], labels[48:]), batch_size=8))


def tp_fit(label: str, *, sharded_logits: bool, extra: tuple[Callback, ...] = ()) -> None:
    torch.manual_seed(3)
    model = Classifier()
    train, val = loaders()
    losses = Losses()
    callbacks = [TensorParallel(plan(sharded_logits)),
                 *([LossParallel()] if sharded_logits else []), *extra, losses]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), train,
                val_data=val, loss_fn=F.cross_entropy, device="cpu", callbacks=callbacks)
    loop.fit(2)
    weights = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value)
               .detach().clone() for name, value in model.state_dict().items()}
    if rank() == 0:
        save(f"{label}-weights", weights)
    save(label, {"losses": losses.values, "kinds": sorted(losses.kinds),
                 "history": loop.state.history})


def main() -> None:
    directory = out_dir()
    ddp_fit()  # DDP creates the process group and destroys it at its fit end
    checkpoints = Path(directory) / "checkpoints"
    tp_fit("parallel", sharded_logits=True,
           extra=(Checkpoint(checkpoints, every_n_epochs=1, keep_last=2),))
    tp_fit("plain", sharded_logits=False)
    (first,) = checkpoints.glob("epoch=0000-*.pt")
    tp_fit("resumed", sharded_logits=True,
           extra=(Checkpoint(Path(directory) / "resumed", resume=str(first)),))


if __name__ == "__main__":
    main()
