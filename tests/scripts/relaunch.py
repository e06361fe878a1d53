"""A run that EarlyStopping ends, relaunched with more epochs, as a user script runs it (the
relaunch messages of EarlyStopping and LRScheduler are read from its output).

    python relaunch.py CHECKPOINT_DIR --epochs 6 [--restart-patience] [--no-schedule]

The monitored ``val_score`` never improves after the first validation, so with patience 2
the run stops after its third epoch. Prints ``result: epoch E step S lr LR stopped: REASON``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, EarlyStopping, LRScheduler
from hookloop.schedules import warmup_cosine


class Score(Callback):
    """A validation metric that never improves after the first validation."""

    def produces(self, loop: Loop | None) -> Iterable[str]:
        return ("val_score",)

    def on_validation_end(self, loop: Loop) -> None:
        loop.state.metrics["val_score"] = 1.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--restart-patience", action="store_true")
    parser.add_argument("--no-schedule", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]  # 4 steps per epoch
    model = torch.nn.Linear(3, 1)
    callbacks: list[Callback] = [Score()]
    if not args.no_schedule:
        callbacks.append(LRScheduler(functools.partial(warmup_cosine, warmup_steps=2)))
    callbacks += [EarlyStopping("val_score", mode="max", patience=2,
                                restart_patience_on_resume=args.restart_patience),
                  Checkpoint(args.directory, resume=True)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:1],
                loss_fn=F.mse_loss, device="cpu", callbacks=callbacks)
    state = loop.fit(args.epochs)
    print(f"result: epoch {state.epoch + 1} step {state.step} "
          f"lr {loop.optimizer.param_groups[0]['lr']:.6g} stopped: {loop.stop_reason}",
          flush=True)


if __name__ == "__main__":
    main()
