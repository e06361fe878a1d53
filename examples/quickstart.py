"""Quickstart: a small CNN on scikit-learn's bundled digits, with the standard callback stack.

    python examples/quickstart.py                 # train 15 epochs, checkpoints in ./checkpoints
    python examples/quickstart.py --resume        # continue the run left in ./checkpoints
    python examples/quickstart.py --max-steps 20  # a quick smoke run

No download: the 1,797 8x8 digit images ship inside scikit-learn.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hookloop
from hookloop import Callback, Loop
from hookloop.callbacks import (
    AMP,
    EMA,
    Checkpoint,
    EarlyStopping,
    GradClip,
    LRScheduler,
    Metrics,
)
from hookloop.schedules import warmup_cosine


def digits_loaders(batch_size: int = 64, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """80/20 train/validation split of the digits, pixels scaled to [0, 1]."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, val = order[:cut], order[cut:]
    shuffle = torch.Generator().manual_seed(seed)
    return (DataLoader(TensorDataset(images[train], labels[train]), batch_size=batch_size,
                       shuffle=True, generator=shuffle),
            DataLoader(TensorDataset(images[val], labels[val]), batch_size=256))


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                                  nn.Dropout(0.2), nn.Linear(64, classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=-1) == targets).float().mean()


class PrintEpoch(Callback):
    """One line per epoch (rank 0 only)."""

    rank_zero_only = True

    def on_epoch_end(self, loop: Loop) -> None:
        metrics = loop.state.metrics
        if "val_acc" in metrics:
            print(f"epoch {loop.state.epoch + 1:2d}/{loop.state.epochs}  step {loop.state.step:4d}  "
                  f"train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
                  f"val_acc {metrics['val_acc']:.4f}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--checkpoint-dir", default="checkpoints/quickstart")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: CUDA if any)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train_data, val_data = digits_loaders()
    model = SmallCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    callbacks = [
        AMP(torch.bfloat16),                    # autocast forward and loss
        GradClip(1.0),                          # after AMP: clips real gradients
        EMA(0.95),                              # validation uses the averaged weights
        LRScheduler(lambda opt, total: warmup_cosine(opt, total, warmup_steps=0.05)),
        Metrics(acc=accuracy),                  # writes val_acc
        EarlyStopping(monitor="val_acc", mode="max", patience=5),
        PrintEpoch(),
        Checkpoint(args.checkpoint_dir, monitor="val_acc", mode="max", resume=args.resume),
    ]
    loop = Loop(model, optimizer, train_data, val_data=val_data, loss_fn=F.cross_entropy,
                callbacks=callbacks, device=args.device)
    state = loop.fit(args.epochs, max_steps=args.max_steps)

    best = Path(args.checkpoint_dir) / "best.pt"
    if best.exists():
        hookloop.load_checkpoint(best, model)
        loop.callbacks = [Metrics(acc=accuracy)]
        print(f"best checkpoint: val_acc {loop.validate()['val_acc']:.4f}")
    return state.metrics


if __name__ == "__main__":
    main()
