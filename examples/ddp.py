"""Data-parallel training: the same script on one process, N processes or N machines.

    python examples/ddp.py                                   # one process (DDP says so, once)
    torchrun --nproc_per_node=2 examples/ddp.py              # two processes on this machine
    torchrun --nproc_per_node=2 examples/ddp.py --epochs 1   # a quick smoke run
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=node0.example.com:29500 --rdzv_id=digits examples/ddp.py  # 2 machines

The only difference from a single-process script is `DDP()` in the callback list. Each
process trains on its share of the data with ``--batch-size`` samples per batch, so one
optimizer step sees ``batch_size x processes`` samples; validation metrics are computed
over the whole validation set, each sample counted once. On GPUs each process uses
``cuda:LOCAL_RANK`` with NCCL and float16 autocast; on CPUs, gloo and float32.

No download: the 1,797 8x8 digit images ship inside scikit-learn.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Loop, distributed
from hookloop.callbacks import AMP, DDP, Checkpoint, GradAccumulation, Metrics


def digits_loaders(batch_size: int, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """80/20 train/validation split of the digits; plain loaders, DDP shards them."""
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    train, val = order[:cut], order[cut:]
    return (DataLoader(TensorDataset(images[train], labels[train]), batch_size=batch_size,
                       shuffle=True, generator=torch.Generator().manual_seed(seed)),
            DataLoader(TensorDataset(images[val], labels[val]), batch_size=256))


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=-1) == targets).float().mean()


class Report(Callback):
    """Prints on rank 0 only: the other processes leave it out of their dispatch."""

    rank_zero_only = True

    def on_fit_start(self, loop: Loop) -> None:
        print(f"training on {distributed.world_size()} process(es), device {loop.device}, "
              f"{loop.batches_per_epoch} batches per epoch and process", flush=True)

    def on_epoch_end(self, loop: Loop) -> None:
        metrics = loop.state.metrics
        if "val_acc" in metrics:
            print(f"epoch {loop.state.epoch + 1}/{loop.state.epochs}  step {loop.state.step}  "
                  f"train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
                  f"val_acc {metrics['val_acc']:.4f}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--checkpoint-dir", default=None, help="save (rank 0) and resume here")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: CUDA if any)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)  # the same initial weights and data order on every process
    train_data, val_data = digits_loaders(args.batch_size)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    callbacks: list[Callback] = [DDP()]
    if device.type == "cuda":
        callbacks.append(AMP(torch.float16))     # GradScaler on; DDP all-reduces scaled grads
    if args.accumulate > 1:
        callbacks.append(GradAccumulation(args.accumulate))  # no_sync inside each window
    callbacks += [Metrics(acc=accuracy), Report()]
    if args.checkpoint_dir:
        callbacks.append(Checkpoint(args.checkpoint_dir, resume=True))
    loop = Loop(model, optimizer, train_data, val_data=val_data, loss_fn=F.cross_entropy,
                callbacks=callbacks, device=device)
    state = loop.fit(args.epochs, max_steps=args.max_steps)
    return state.metrics


if __name__ == "__main__":
    main()
