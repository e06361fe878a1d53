"""The run of `tests/runfile/test_run_file_written_before_the_parts.py`, and the script that
wrote its files with the tree issue 34 was filed against, before the run's state became a
set of parts (commit dc71d7f; it reports itself as hookloop 0.1.0, as every commit has)::

    git archive dc71d7f | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python tests/runfile/before_parts/before_parts_run.py tests/runfile/before_parts

It trains the run once, uninterrupted, and writes beside this file:

- ``checkpoints/``: the Checkpoint directory as it was right after the save at step 8,
  inside epoch 1 (the rotating files of step 6, epoch 0's end, and of step 8, and
  best.pt of epoch 0);
- ``oracle.pt``: what the run ended with (the weights, the optimizer's learning rate, the
  EMA's and the counter's states, the history), for a resumed run to match bit for bit,
  and the torch version and CPU capability that computed it.

The stack holds what a resume restores beyond the weights: the optimizer's moments, a
learning-rate schedule, an EMA, a top-1 ranking, a ``state=`` object, dropout's and the
shuffling sampler's random draws, and a position inside an epoch.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Loop
from hookloop.callbacks import EMA, Checkpoint, LRScheduler

EPOCHS, SNAPSHOT_STEP = 3, 8


class Counter:
    """A ``state=`` object: the batches seen, kept in the run's state."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state["seen"])


class Count(Callback):
    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def on_batch_end(self, loop: Loop) -> None:
        self.counter.seen += 1


class Snapshot(Callback):
    """After the Checkpoint's save at `SNAPSHOT_STEP`: copy its directory to ``target``."""

    def __init__(self, source: Path, target: Path) -> None:
        self.source, self.target = source, target

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step == SNAPSHOT_STEP:
            shutil.copytree(self.source, self.target,  # not the lock this process holds
                            ignore=shutil.ignore_patterns(".hookloop.lock"))


def build(dirpath: Path, *, resume: bool, extra: tuple[Callback, ...] = (),
          hidden: int = 16) -> tuple[Loop, EMA, Counter]:
    """The run's loop (the model ``hidden`` wide) over a Checkpoint in ``dirpath``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 1))
    x = torch.randn(48, 4)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(48, 1)
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(3))
    val = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ema, counter = EMA(decay=0.9), Counter()
    callbacks = [LRScheduler(lambda opt, total: torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5)),
                 ema, Count(counter),
                 Checkpoint(dirpath, monitor="val_loss", every_n_steps=4, keep_last=2,
                            resume=resume), *extra]
    loop = Loop(model, optimizer, train, val_data=val, loss_fn=nn.functional.mse_loss,
                device="cpu", callbacks=callbacks, state={"counter": counter})
    return loop, ema, counter


def outcome(loop: Loop, ema: EMA, counter: Counter) -> dict[str, Any]:
    """What a run ended with, as the oracle holds it."""
    return {"model": loop.model.state_dict(), "lr": loop.optimizer.param_groups[0]["lr"],
            "ema": ema.state_dict(), "counter": counter.state_dict(),
            "history": [dict(row) for row in loop.state.history]}


def machine() -> dict[str, str]:
    """What decides the float results besides the code: torch's version and the CPU kernels
    it runs (another CPU capability sums in another order)."""
    return {"torch": str(torch.__version__), "cpu": torch.backends.cpu.get_cpu_capability()}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    loop, ema, counter = build(work, resume=False,
                               extra=(Snapshot(work, out / "checkpoints"),))
    loop.fit(EPOCHS)
    torch.save({**outcome(loop, ema, counter), "machine": machine()}, out / "oracle.pt")
    shutil.rmtree(work)
    import hookloop
    print(f"written by the hookloop at {Path(hookloop.__file__).parent}:",
          sorted(path.name for path in (out / "checkpoints").iterdir()))
