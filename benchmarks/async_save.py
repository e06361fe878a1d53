"""How long a training step waits for a checkpoint: synchronous against async saves.

The same run (an MLP with AdamW, so a file holds the weights and two moments) is trained
twice with ``Checkpoint(every_n_steps=...)``, once with ``async_save=False`` and once with
``async_save=True``. Two probe callbacks around `Checkpoint` time its ``on_batch_end`` at the
steps that save: that is what the step waits for (the whole write synchronously; the copy
into host memory, and any wait for the previous write still in flight, asynchronously). The
background writes are timed where the file is written. The runs alternate over ``--rounds``
and the medians are reported.

Usage:
    python benchmarks/async_save.py [--width 2048] [--saves 8] [--every 16] [--rounds 3]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint
from hookloop.runfile import background_save, checkpoint_files


class Probe(Callback):
    """Marks the time at on_batch_end; the pair around Checkpoint gives its duration."""

    def __init__(self, marks: list[float]) -> None:
        self.marks = marks

    def on_batch_end(self, loop: Loop) -> None:
        self.marks.append(time.perf_counter())


def run(width: int, saves: int, every: int, background: bool, device: str
        ) -> tuple[list[float], list[float], list[float], float, int]:
    """One fit; returns the blocking seconds of each saving step, the write seconds, the
    host-copy seconds, the fit's seconds, and the size of the last file."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                          nn.ReLU(), nn.Linear(width, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [(torch.randn(32, width), torch.randint(0, 10, (32,)))
               for _ in range(saves * every)]
    before, after = [], []
    writes: list[float] = []
    copies: list[float] = []
    real, real_copy = checkpoint_files.write_atomic, background_save.host_copy

    def timed(payload: object, path: str) -> None:
        start = time.perf_counter()
        real(payload, path)
        writes.append(time.perf_counter() - start)

    def timed_copy(payload: object) -> object:
        start = time.perf_counter()
        copied = real_copy(payload)
        copies.append(time.perf_counter() - start)
        return copied

    checkpoint_files.write_atomic, background_save.host_copy = timed, timed_copy
    try:
        with tempfile.TemporaryDirectory() as directory:
            loop = Loop(model, optimizer, batches, loss_fn=F.cross_entropy, device=device,
                        sanity_val_batches=0,
                        callbacks=[Probe(before),
                                   Checkpoint(directory, every_n_steps=every, every_n_epochs=None,
                                              keep_last=1, async_save=background),
                                   Probe(after)])
            started = time.perf_counter()
            loop.fit(1)
            seconds = time.perf_counter() - started
            size = sum(os.path.getsize(os.path.join(directory, name))
                       for name in os.listdir(directory) if name.endswith(".pt"))
    finally:
        checkpoint_files.write_atomic, background_save.host_copy = real, real_copy
    blocking = [end - start for step, (start, end) in enumerate(zip(before, after), start=1)
                if step % every == 0]
    return blocking, writes, copies, seconds, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the MLP")
    parser.add_argument("--saves", type=int, default=8, help="saves per run")
    parser.add_argument("--every", type=int, default=16, help="steps between saves")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    results: dict[str, list[list[float]]] = {"sync": [[], [], [], []],
                                             "async": [[], [], [], []]}
    size = 0
    for _ in range(args.rounds):
        for name, background in (("sync", False), ("async", True)):
            blocking, writes, copies, seconds, size = run(args.width, args.saves, args.every,
                                                          background, args.device)
            for kept, values in zip(results[name], (blocking, writes, copies, [seconds])):
                kept.extend(values)
    print(f"checkpoint file: {size / 2**20:.1f} MB, {args.saves} saves every {args.every} "
          f"steps x {args.rounds} rounds, device {args.device}")
    for name, (blocking, writes, copies, seconds) in results.items():
        copy = f"  host copy {statistics.median(copies) * 1e3:7.1f} ms" if copies else ""
        print(f"{name:5s}  step waits median {statistics.median(blocking) * 1e3:7.1f} ms "
              f"(max {max(blocking) * 1e3:7.1f}){copy}  file write median "
              f"{statistics.median(writes) * 1e3:7.1f} ms  fit {statistics.median(seconds):6.2f} s")
    ratio = statistics.median(results["async"][0]) / statistics.median(results["sync"][0])
    print(f"async/sync blocking ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
