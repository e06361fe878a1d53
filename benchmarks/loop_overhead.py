"""Overhead of hookloop's loop against a hand-written loop doing the same work.

Both train the same MLP on the same in-memory batches (no DataLoader, so the loop itself
is what is measured) and both accumulate the epoch loss on the device and read it once.
The "observers" variant adds TensorBoard(every_n_steps=50), a ProgressBar writing plain
lines (not a terminal) and a CSVLogger, each run writing into a fresh temporary folder.
Runs are interleaved (hand, hookloop, hookloop with listeners..., in a rotating order) so
that drift of the machine hits all variants alike; the result is the median ratio of
each variant's time to the hand-written loop's time in the same round.

Usage:
    python benchmarks/loop_overhead.py [--rounds 15] [--batches 300] [--device cpu]
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, Loop


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def hand_written(model, optimizer, batches, device) -> float:
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = 0
    for inputs, targets in batches:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        outputs = model(inputs)
        loss = F.cross_entropy(outputs, targets)
        loss_sum = torch.add(loss_sum, loss.detach(), alpha=targets.shape[0])
        samples += targets.shape[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss_sum.item() / samples


class Listener(Callback):
    """Listens to every per-batch training event and does nothing."""

    def on_batch_start(self, loop):
        pass

    def after_forward(self, loop):
        pass

    def after_backward(self, loop):
        pass

    def before_step(self, loop):
        pass

    def after_step(self, loop):
        pass

    def on_batch_end(self, loop):
        pass


def with_hookloop(model, optimizer, batches, device, callbacks) -> float:
    loop = Loop(model, optimizer, batches, loss_fn=F.cross_entropy, callbacks=callbacks,
                device=device)
    return loop.fit(1).metrics["train_loss"]


def observers(directory: str) -> list[Callback]:
    """TensorBoard, a non-terminal ProgressBar and a CSVLogger, each in a fresh place."""
    from rich.console import Console

    from hookloop.callbacks import CSVLogger, ProgressBar, TensorBoard

    run = tempfile.mkdtemp(dir=directory)
    return [TensorBoard(run, every_n_steps=50),
            ProgressBar(console=Console(file=io.StringIO(), force_terminal=False)),
            CSVLogger(f"{run}/log.csv", every_n_steps=50)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    batches = [(torch.randn(args.batch_size, 64), torch.randint(0, 10, (args.batch_size,)))
               for _ in range(args.batches)]
    scratch = tempfile.TemporaryDirectory()  # event files and CSVs of the observers variant
    variants = {
        "hand-written": lambda m, o: hand_written(m, o, batches, device),
        "hookloop": lambda m, o: with_hookloop(m, o, batches, device, []),
        "hookloop+6 listeners": lambda m, o: with_hookloop(m, o, batches, device, [Listener()]),
        "hookloop+observers": lambda m, o: with_hookloop(m, o, batches, device,
                                                         observers(scratch.name)),
    }
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds + 1):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            model = make_model(args.width).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            synchronize(device)
            start = time.perf_counter()
            variants[name](model, optimizer)
            synchronize(device)
            if round_index:  # round 0 warms up caches and allocators
                times[name].append(time.perf_counter() - start)
    base = times["hand-written"]
    print(f"device={device} batches={args.batches} batch_size={args.batch_size} "
          f"width={args.width} rounds={args.rounds}")
    for name in names:
        ratios = sorted(t / b for t, b in zip(times[name], base))
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        per_batch_us = statistics.median(times[name]) / args.batches * 1e6
        print(f"{name:22s} median {statistics.median(times[name]) * 1e3:8.1f} ms  "
              f"{per_batch_us:7.1f} us/batch  ratio {statistics.median(ratios):.3f} "
              f"(IQR {quartiles[0]:.3f}-{quartiles[2]:.3f})")


if __name__ == "__main__":
    main()
