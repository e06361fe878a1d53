"""torchrun script: the options of issue 28 on two ranks (DDP, gloo), one scenario after
another in the same processes.

Usage: torchrun --nproc_per_node=2 day_one.py OUT

* ``timed``: ``Checkpoint(every_n_seconds=15)``; rank 0's clock advances 10 s a training
  batch, rank 1's stands still, so only rank 0 can find the time up. Every rank writes
  ``timed`` (the steps at which it saved: the collective ``loop.state_dict`` calls) and
  rank 0 the files on disk.
* ``held``: ``fit(6, min_epochs=4)`` with ``EarlyStopping(patience=1)`` on a scripted metric
  that worsens on rank 0 and improves on rank 1 (the monitor reads rank 0's), and
  ``Loop(val_at_start=True)``. Every rank writes ``held`` (epoch, step, stop reason, the
  history's steps and its first ``val_loss``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from common import make_model, make_optimizer, out_dir, rank, regression_data, save
from hookloop import Callback, Loop
from hookloop.callbacks import DDP, Checkpoint, EarlyStopping


class Clock(Callback):
    """This rank's clock for `Checkpoint`: ``tick`` seconds more at every training batch."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 100.0, tick

    def __call__(self) -> float:
        return self.now

    def on_batch_end(self, loop: Loop) -> None:
        self.now += self.tick


class Scripted(Callback):
    """``val_score`` = this rank's value for the epoch (the start validation: epoch -1)."""

    def __init__(self, values: list[float]) -> None:
        self.values, self.seen = values, 0

    def produces(self, loop: Loop) -> list[str]:
        return ["val_score"]

    def on_validation_end(self, loop: Loop) -> None:
        if loop.sanity_checking:
            return
        loop.state.metrics["val_score"] = self.values[self.seen]
        self.seen += 1


def loop_with(callbacks: list[Callback], **options: object) -> Loop:
    model = make_model(seed=0)
    train = DataLoader(regression_data(64, seed=1), batch_size=4)  # 8 batches a rank
    val = DataLoader(regression_data(16, seed=2), batch_size=4)
    return Loop(model, make_optimizer(model), train, val_data=val,
                loss_fn=torch.nn.functional.mse_loss, device="cpu",
                callbacks=[DDP(), *callbacks], **options)


def timed(out: Path) -> None:
    import hookloop.parallel.suspension

    clock = Clock(10.0 if rank() == 0 else 0.0)
    hookloop.parallel.suspension.time.monotonic = clock  # type: ignore[assignment]  # this process only
    directory = out / "timed"
    loop = loop_with([clock, Checkpoint(directory, every_n_epochs=None, keep_last=None,
                                        every_n_seconds=15)])
    saves: list[int] = []
    state_dict = loop.state_dict

    def recorded(**options: object) -> dict:
        saves.append(loop.state.step)
        return state_dict(**options)

    loop.state_dict = recorded  # type: ignore[method-assign]
    loop.fit(2)
    files = sorted(path.name for path in directory.glob("epoch=*.pt")) if rank() == 0 else []
    save("timed", {"saves": saves, "files": files})


def held(out: Path) -> None:
    values = [float(value) for value in range(1, 9)] if rank() == 0 else \
        [float(value) for value in range(9, 1, -1)]
    stopping = EarlyStopping("val_score", mode="min", patience=1)
    loop = loop_with([Scripted(values), stopping], val_at_start=True)
    state = loop.fit(6, min_epochs=4)
    save("held", {"epoch": state.epoch, "step": state.step, "reason": loop.stop_reason,
                  "steps": [row["step"] for row in state.history],
                  "first_val_loss": state.history[0]["val_loss"]})


if __name__ == "__main__":
    out = out_dir()
    timed(out)
    held(out)
    sys.exit(0)
