"""One training run as a user script runs it, for the run-state tests (a fresh process each).

    python run_state.py OUT_DIR --epochs 4 [--max-steps N] [--resume | --resume-from FILE]
        [--schedule onecycle|cosine|none] [--stop-after-epoch E] [--optimizer adam|sgd]

Writes OUT_DIR/result.pt: the final weights, the learning rate of every optimizer step
trained in this process (with its step), and the loop's stop reason.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, EarlyStopping, LRScheduler, Metrics
from hookloop.schedules import warmup_cosine

SAMPLES, BATCH = 48, 8  # 6 steps per epoch


def onecycle(optimizer: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)


SCHEDULES = {"onecycle": onecycle, "cosine": functools.partial(warmup_cosine, warmup_steps=3),
             "none": None}


class RecordSteps(Callback):
    """The learning rate used by each optimizer step this process trains."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []

    def before_step(self, loop: Loop) -> None:
        self.steps.append((loop.state.step + 1, loop.optimizer.param_groups[0]["lr"]))


class ScriptedScore(Callback):
    """val_score rises for two validations, then falls: EarlyStopping(patience=1) stops."""

    def produces(self, loop: Loop) -> list[str]:
        return ["val_score"]

    def on_validation_end(self, loop: Loop) -> None:
        loop.state.metrics["val_score"] = [0.5, 0.7, 0.6, 0.55, 0.5, 0.4, 0.3, 0.2][
            len([row for row in loop.state.history])] if not loop.sanity_checking else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="none")
    parser.add_argument("--early-stopping", action="store_true")
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--keep-last", type=int, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(SAMPLES + 16, 5, generator=generator)
    targets = (inputs[:, 0] > 0).long()
    train = DataLoader(TensorDataset(inputs[:SAMPLES], targets[:SAMPLES]), batch_size=BATCH,
                       shuffle=True, generator=torch.Generator().manual_seed(2))
    val = DataLoader(TensorDataset(inputs[SAMPLES:], targets[SAMPLES:]), batch_size=8)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    optimizer = (torch.optim.Adam(model.parameters(), lr=0.01) if args.optimizer == "adam"
                 else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    record = RecordSteps()
    callbacks: list[Callback] = [record]
    if SCHEDULES[args.schedule] is not None:
        callbacks.append(LRScheduler(SCHEDULES[args.schedule]))
    callbacks.append(Metrics(acc=lambda out, y: (out.argmax(-1) == y).float().mean()))
    if args.early_stopping:
        callbacks += [ScriptedScore(), EarlyStopping("val_score", patience=2, mode="max")]
    resume: bool | str = args.resume_from or args.resume
    callbacks.append(Checkpoint(args.out / "ckpt", keep_last=args.keep_last, resume=resume))
    loop = Loop(model, optimizer, train, val_data=val, loss_fn=nn.functional.cross_entropy,
                callbacks=callbacks, device="cpu")
    loop.fit(args.epochs, max_steps=args.max_steps)
    torch.save({"weights": model.state_dict(), "steps": record.steps,
                "stop_reason": loop.stop_reason, "step": loop.state.step,
                "history": loop.state.history}, args.out / "result.pt")


if __name__ == "__main__":
    main()
