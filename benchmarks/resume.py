"""How long a resume inside an epoch takes to its first trained batch, by position.

A run over ``--samples`` samples whose ``__getitem__`` costs ``--cost-ms`` (a sleep, as a
decode would) is stopped (``loop.stop(resumable=True)``: a checkpoint at the step
boundary) at 10%, 50% and 90% of its first epoch, then resumed in a new `Loop`; the time
from ``fit()`` to the first trained batch's ``on_batch_start`` is reported for

- ``sampler``: a ``DataLoader`` over the map-style dataset (hookloop advances its sampler),
- ``stateful``: torchdata's ``StatefulDataLoader`` (its own state), when installed,
- ``replay``: the same batches behind a plain iterable (fetched again up to the position),

each with ``num_workers`` 0 and 2. The first launch reads its samples at no cost (the
dataset's cost is switched on for the resume only), so the table measures the resume.

It also reports the cost of the workers' generator snapshots hookloop attaches to each
batch (``num_workers > 0``): the per-batch time of a loop over the loader with and
without them (the same loader, the same workers).

Usage:
    python benchmarks/resume.py [--samples 20000] [--cost-ms 1] [--batch 32]
        [--fractions 0.1 0.5 0.9] [--workers 0 2] [--kinds sampler stateful replay]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint
from hookloop.engine.resumable import WorkerStamp


class Slow(Dataset):
    """Samples of 8 features; each read sleeps ``cost`` seconds once ``slow`` is set."""

    slow = False

    def __init__(self, samples: int, cost: float) -> None:
        self.x = torch.randn(samples, 8, generator=torch.Generator().manual_seed(0))
        self.cost = cost

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if Slow.slow:
            time.sleep(self.cost)
        return self.x[index], self.x[index, :1]


class Replayed:
    """The loader's batches behind an iterable without a sampler or a state."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Any:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def build(kind: str, dataset: Slow, batch: int, workers: int) -> Any:
    options = dict(batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(1),
                   num_workers=workers)
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, **options)
    loader = DataLoader(dataset, **options)
    return Replayed(loader) if kind == "replay" else loader


class StopAtStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step == self.step:
            loop.stop("benchmark position", resumable=True)


class FirstBatch(Callback):
    """Marks the time of the first trained batch and ends the fit there."""

    def __init__(self) -> None:
        self.at: float | None = None

    def on_batch_start(self, loop: Loop) -> None:
        if self.at is None:
            self.at = time.perf_counter()
            loop.stop("measured")


def loop_for(data: Any, callbacks: list[Callback]) -> Loop:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), data,
                loss_fn=nn.functional.mse_loss, callbacks=callbacks, device="cpu",
                sanity_val_batches=0)


def resume_seconds(kind: str, args: argparse.Namespace, workers: int, fraction: float) -> float:
    dataset = Slow(args.samples, args.cost_ms / 1000)
    batches = -(-args.samples // args.batch)
    step = max(1, int(batches * fraction))
    with tempfile.TemporaryDirectory() as directory:
        Slow.slow = False
        first = loop_for(build(kind, dataset, args.batch, workers),
                         [Checkpoint(directory, every_n_epochs=None), StopAtStep(step)])
        try:
            first.fit(1)
        except SystemExit:  # the resumable stop ends the launch with its status
            pass
        Slow.slow = True
        probe = FirstBatch()
        resumed = loop_for(build(kind, dataset, args.batch, workers),
                           [Checkpoint(directory, resume=True, every_n_epochs=None), probe])
        start = time.perf_counter()
        resumed.fit(1)
        Slow.slow = False
        assert probe.at is not None and resumed.position.batches_done == step + 1
        return probe.at - start


def snapshot_cost(args: argparse.Namespace, workers: int) -> tuple[float, float]:
    """Microseconds per batch of a pass over the loader without and with the stamps."""
    dataset = Slow(args.samples, 0.0)
    Slow.slow = False
    results = []
    for stamped in (False, True):
        loader = DataLoader(dataset, batch_size=args.batch, num_workers=workers)
        if stamped:
            loader.collate_fn = WorkerStamp(loader.collate_fn)
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            count = sum(1 for _ in loader)
            best = min(best, (time.perf_counter() - start) / count * 1e6)
        results.append(best)
    return results[0], results[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--cost-ms", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--kinds", nargs="*", default=["sampler", "stateful", "replay"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.samples} samples of {args.cost_ms} ms each, batch {args.batch}: seconds "
          "from fit() to the first trained batch of a resume at each position of the epoch\n")
    header = " | ".join(f"{int(f * 100)}%" for f in args.fractions)
    print(f"| data | num_workers | {header} | 90%/10% |")
    print("|---|---:|" + "---:|" * (len(args.fractions) + 1))
    for kind in args.kinds:
        if kind == "stateful":
            try:
                import torchdata.stateful_dataloader  # noqa: F401
            except ImportError:
                print("| stateful | - | torchdata is not installed |")
                continue
        for workers in args.workers:
            seconds = [resume_seconds(kind, args, workers, f) for f in args.fractions]
            ratio = seconds[-1] / seconds[0]
            cells = " | ".join(f"{value:.2f}" for value in seconds)
            print(f"| {kind} | {workers} | {cells} | {ratio:.2f} |", flush=True)
    print("\nworkers' generator snapshots (one per batch), microseconds per batch of a pass "
          "over the loader (best of rounds, samples at no cost):\n")
    print("| num_workers | without | with | cost per batch |")
    print("|---:|---:|---:|---:|")
    for workers in (w for w in args.workers if w > 0):
        without, with_stamps = snapshot_cost(args, workers)
        print(f"| {workers} | {without:.1f} | {with_stamps:.1f} | "
              f"{with_stamps - without:+.1f} |", flush=True)


if __name__ == "__main__":
    main()
