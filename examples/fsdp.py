"""Sharded training: a model's weights, gradients and optimizer state split over processes.

    python examples/fsdp.py                                  # one process (FSDP says so, once)
    torchrun --nproc_per_node=2 examples/fsdp.py             # sharded over two processes
    torchrun --nproc_per_node=2 examples/fsdp.py --epochs 1 --checkpoint-dir ckpt
    torchrun --nproc_per_node=4 examples/fsdp.py --checkpoint-dir ckpt   # resumes on 4

`FSDP(wrap={Block})` shards each residual block on its own (its parameters are gathered
just for its forward and backward) and the root with what is left; the optimizer built
over the whole model is re-pointed at the shards. With ``--checkpoint-dir`` every rank
writes its shards of each checkpoint into one directory (``state_dict="sharded"``), which
a relaunch on any number of processes resumes. On GPUs each process uses
``cuda:LOCAL_RANK`` with NCCL and computes in bfloat16 (FSDP's mixed precision); on CPUs,
gloo and float32.

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
from hookloop.callbacks import EMA, FSDP, Checkpoint, GradAccumulation, GradClip, Metrics


class Block(nn.Module):
    """A residual MLP block: the unit FSDP shards and gathers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.norm(hidden))


class Net(nn.Module):
    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(images)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def digits_loaders(batch_size: int, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """80/20 train/validation split of the digits; plain loaders, FSDP shards them."""
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
    """Prints on rank 0 only: the share of the weights it holds, then each epoch."""

    rank_zero_only = True

    def on_fit_start(self, loop: Loop) -> None:
        params = list(loop.unwrapped_model.parameters())
        held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
        total = sum(p.numel() for p in params)  # a DTensor's numel is the whole tensor's
        print(f"training on {distributed.world_size()} process(es), device {loop.device}: "
              f"rank 0 holds {held:,} of the {total:,} weights", flush=True)

    def on_epoch_end(self, loop: Loop) -> None:
        metrics = loop.state.metrics
        if "val_acc" in metrics:
            print(f"epoch {loop.state.epoch + 1}/{loop.state.epochs}  step {loop.state.step}  "
                  f"train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
                  f"val_acc {metrics['val_acc']:.4f}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--checkpoint-dir", default=None, help="sharded checkpoints; resumes")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: CUDA if any)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)  # the same initial weights and data order on every process
    train_data, val_data = digits_loaders(args.batch_size)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    precision = torch.bfloat16 if device.type == "cuda" else None
    callbacks: list[Callback] = [FSDP(wrap={Block}, mixed_precision=precision,
                                      state_dict="sharded")]
    if args.accumulate > 1:
        callbacks.append(GradAccumulation(args.accumulate))  # one reduce-scatter per step
    callbacks += [GradClip(1.0), EMA(0.99), Metrics(acc=accuracy), Report()]
    if args.checkpoint_dir:
        callbacks.append(Checkpoint(args.checkpoint_dir, monitor="val_acc", resume=True))
    loop = Loop(model, optimizer, train_data, val_data=val_data, loss_fn=F.cross_entropy,
                callbacks=callbacks, device=device)
    state = loop.fit(args.epochs, max_steps=args.max_steps)
    return state.metrics


if __name__ == "__main__":
    main()
