"""A run keeping its best files, as a user script runs it (a fresh process each launch).

    python best_files.py OUT_DIR --values 0.9,0.5,... [--k 2] [--epochs 8] [--keep-last N]
        [--resume | --resume-from FILE] [--kill-at-validation E] [--kill-after-moves N]
        [--hold]

The monitored ``val_score`` of the i-th validation of the run is ``values[i]`` (mode min),
so the ranking is known by hand; the training itself is real (shuffled data, dropout), so
the weights in every file are those of an exact resume or not. Checkpoints go to
OUT_DIR/ckpt. When the run finishes, OUT_DIR/result.pt holds the final weights, the
history and ``Checkpoint.top_k``.

``--kill-at-validation E``: SIGKILL right after the validation of epoch E was ranked (its
best files written), before that epoch's rotating file. ``--kill-after-moves N``: SIGKILL
after the N-th file a rollback moved into ``retired-after-step=...``. ``--hold``: after the
first batch, write OUT_DIR/started and wait for OUT_DIR/release (a second launch can try
the same directory meanwhile).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Loop, Phase
from hookloop.callbacks import Checkpoint


class Score(Callback):
    def __init__(self, values: list[float]) -> None:
        self.values = values

    def produces(self, loop: Loop) -> list[str]:
        return ["val_score"]

    def on_validation_end(self, loop: Loop) -> None:
        if loop.phase is Phase.VALIDATE:
            loop.state.metrics["val_score"] = self.values[len(loop.state.history)]


class KillAfterValidation(Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_validation_end(self, loop: Loop) -> None:
        if loop.phase is Phase.VALIDATE and loop.state.epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


class Hold(Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.held = out, False

    def on_batch_end(self, loop: Loop) -> None:
        if self.held:
            return
        self.held = True
        (self.out / "started").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not (self.out / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def kill_after_moves(count: int) -> None:
    """SIGKILL once ``count`` files were moved into a rollback's retired folder."""
    real, moved = os.replace, []

    def replace(source, target, *args, **kwargs):
        real(source, target, *args, **kwargs)
        if "retired-after-step=" in os.fspath(target):
            moved.append(target)
            if len(moved) == count:
                os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--values", required=True)
    parser.add_argument("--k", default="1")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--keep-last", default="1")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--kill-at-validation", type=int, default=None)
    parser.add_argument("--kill-after-moves", type=int, default=None)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kill_after_moves is not None:
        kill_after_moves(args.kill_after_moves)
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(40, 4, generator=generator), torch.randn(40, 1, generator=generator)
    train = DataLoader(TensorDataset(inputs[:32], targets[:32]), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(2))  # 4 steps per epoch
    val = DataLoader(TensorDataset(inputs[32:], targets[32:]), batch_size=8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    none_or_int = lambda text: None if text == "none" else int(text)  # noqa: E731
    checkpoint = Checkpoint(args.out / "ckpt", monitor="val_score", mode="min",
                            save_top_k=none_or_int(args.k), keep_last=none_or_int(args.keep_last),
                            resume=args.resume_from or args.resume)
    callbacks: list[Callback] = [Score([float(v) for v in args.values.split(",")]), checkpoint]
    if args.kill_at_validation is not None:
        callbacks.append(KillAfterValidation(args.kill_at_validation))
    if args.hold:
        callbacks.append(Hold(args.out))
    loop = Loop(model, optimizer, train, val_data=val, loss_fn=nn.functional.mse_loss,
                device="cpu", callbacks=callbacks)
    state = loop.fit(args.epochs)
    torch.save({"weights": model.state_dict(), "history": state.history,
                "top_k": [dict(entry) for entry in checkpoint.top_k]}, args.out / "result.pt")


if __name__ == "__main__":
    main()
