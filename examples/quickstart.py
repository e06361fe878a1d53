"""Quickstart: a small CNN on scikit-learn's bundled digits, with the standard preset.

    python examples/quickstart.py                 # a new run in runs/quickstart/version_N
    python examples/quickstart.py --resume        # continue the newest run (after a kill)
    python examples/quickstart.py --epochs 20 --resume   # raise the newest run's total to 20
    python examples/quickstart.py --epochs 20 --resume --restart-patience
    python examples/quickstart.py --max-steps 20  # a quick smoke run
    tensorboard --logdir runs/quickstart          # the curves of every run

Each run gets its own directory (version_0, version_1, ...) holding its checkpoints and
its TensorBoard logs, so running the script twice never mixes two runs. No download: the
1,797 8x8 digit images ship inside scikit-learn.

``--epochs 20 --resume`` continues the newest run up to 20 epochs in all, with two catches
that it prints at the start: the warmup-cosine schedule is rebuilt for the longer run (the
learning rate jumps to the longer schedule's), and after an early stop EarlyStopping's
restored patience is used up, so the run stops again after its next validation that does
not improve val_acc. ``--restart-patience`` gives it fresh patience (the best is kept).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, presets
from hookloop.callbacks import AMP, EarlyStopping, Metrics


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
    """Two convolutions and a small head: enough for 8x8 digits."""

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


def run_directory(root: Path, resume: bool) -> tuple[Path, str]:
    """The directory of this run and a sentence saying whether it is new or resumed."""
    versions = sorted(int(path.name.removeprefix("version_")) for path in root.glob("version_*")
                      if path.name.removeprefix("version_").isdigit())
    if resume and versions:
        return root / f"version_{versions[-1]}", "resuming the newest run"
    directory = root / f"version_{versions[-1] + 1 if versions else 0}"
    if resume:
        return directory, f"nothing to resume in {root}: a new run"
    if versions:
        return directory, (f"a new run (--resume continues {root / f'version_{versions[-1]}'} "
                           "instead)")
    return directory, "a new run"


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15, help="epochs of the run in all")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--root", default="runs/quickstart",
                        help="where the version_N run directories go")
    parser.add_argument("--resume", action="store_true", help="continue the newest run in --root")
    parser.add_argument("--restart-patience", action="store_true",
                        help="with --resume: early stopping counts its patience from 0 again")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: CUDA if any)")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    directory, what = run_directory(Path(args.root), args.resume)
    print(f"run directory: {directory} ({what})", flush=True)

    torch.manual_seed(0)
    train_data, val_data = digits_loaders()
    model = SmallCNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    callbacks = presets.standard(
        ema=0.95,                                 # a short run: a short average
        metrics={"acc": accuracy}, monitor="val_acc",
        checkpoint_dir=directory / "checkpoints", tensorboard=directory / "tensorboard",
        resume=args.resume, progress=not args.no_progress)
    for callback in callbacks:
        if isinstance(callback, EarlyStopping):
            callback.restart_patience_on_resume = args.restart_patience
    loop = Loop(model, optimizer, train_data, val_data=val_data, loss_fn=F.cross_entropy,
                callbacks=callbacks, device=args.device)
    state = loop.fit(args.epochs, max_steps=args.max_steps)
    if "val_acc" in state.metrics:
        print(f"last epoch: epoch {state.epoch + 1}/{args.epochs}  step {state.step}  "
              f"val_acc {state.metrics['val_acc']:.4f}  ({time.perf_counter() - started:.1f} s)")
    else:
        print(f"nothing left to train at step {state.step} ({loop.stop_reason or 'the run is done'}); "
              f"pass a larger --epochs with --resume to train longer")

    best = directory / "checkpoints" / "best.pt"
    if best.exists():
        # best.pt holds the weights that were validated (EMA's) and the score they got.
        saved = torch.load(best, weights_only=True)
        model.load_state_dict(saved["model"])
        # Validate them again as in training: under the same autocast, without EMA's swap.
        loop.callbacks = [callback for callback in callbacks if isinstance(callback, (AMP, Metrics))]
        again = loop.validate()["val_acc"]
        print(f"best checkpoint: epoch {saved['epoch'] + 1}  step {saved['step']}  "
              f"val_acc {saved['hookloop']['value']:.4f}  (validated again: {again:.4f})  {best}")
    return state.metrics


if __name__ == "__main__":
    main()
