"""What a checkpoint costs the step and what its verification costs: the numbers issue 36
item 5 asks for, each as a ratio against the plain torch path.

* ``blocked``: how long the loop waits at a step that saves with ``Checkpoint(async_save=
  True)`` (probes around `Checkpoint`'s ``on_batch_end``), against one plain host copy of the
  same state (``{k: v.detach().to("cpu", copy=True)}`` of the model's and the optimizer's
  tensors), and the step time while a save runs in the background against a step with none.
* ``file``: a single ``.pt`` file saved by hookloop (`CheckpointFiles.write`: temporary
  file, fsync, rename; torch.save's CRC-32s are its digests) against ``torch.save`` (and
  against ``torch.save`` with an fsync: the same durability), and read back verified
  (`hookloop.runfile.format.read_payload`: every CRC checked) against ``torch.load``; both
  loads end with the tensors copied into the model's own (as a resume does).
* ``sharded``: a directory of shards (DCP, one process) with hookloop's save id and
  SHA-256 digests against plain ``dcp.save`` / ``dcp.load``.

Each pair alternates over ``--rounds`` and the medians are reported.

Usage:
    python benchmarks/save_speed.py [--mb 256] [--rounds 5] [--parts blocked file sharded]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint
from hookloop.runfile import shard_files
from hookloop.runfile.checkpoint_files import CheckpointFiles, file_meta
from hookloop.runfile.format import SHARDS, read_payload


def _state(megabytes: int) -> dict[str, torch.Tensor]:
    pieces = 8
    torch.manual_seed(0)
    return {f"layer{index}.weight": torch.randn(megabytes * (1 << 20) // 4 // pieces)
            for index in range(pieces)}


def _timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _into(targets: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, target in targets.items():
            target.copy_(loaded[key])


def _median_pairs(rounds: int, pairs: dict[str, Callable[[], tuple[float, float]]]
                  ) -> dict[str, tuple[float, float]]:
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in pairs}
    for _ in range(rounds):
        for name, run in pairs.items():
            times[name].append(run())
    return {name: (statistics.median(s for s, _ in runs), statistics.median(l for _, l in runs))
            for name, runs in times.items()}


def _report(label: str, medians: dict[str, tuple[float, float]], gigabytes: float) -> None:
    (saved, loaded), (plain_saved, plain_loaded) = medians["verified"], medians["plain"]
    print(f"{label}: {gigabytes:.3f} GB  save {saved:.3f} s vs {plain_saved:.3f} s  "
          f"load {loaded:.3f} s vs {plain_loaded:.3f} s")
    print(f"{label} verified/plain: save {saved / plain_saved:.3f}x  "
          f"load {loaded / plain_loaded:.3f}x")
    if "synced" in medians:  # the same durability: the bytes on the disk when it returns
        print(f"{label} verified/plain+fsync: save {saved / medians['synced'][0]:.3f}x")


def single_file(megabytes: int, rounds: int, directory: str) -> None:
    state = _state(megabytes)
    targets = {key: torch.empty_like(value) for key, value in state.items()}
    files = CheckpointFiles(directory)
    payload = {"hookloop": file_meta("best"), "model": state}

    def verified() -> tuple[float, float]:
        path = files.path("verified.pt")
        saved = _timed(lambda: files.write(payload, "verified.pt"))
        loaded = _timed(lambda: _into(targets, read_payload(path, "cpu")["model"]))
        os.unlink(path)
        return saved, loaded

    def plain() -> tuple[float, float]:
        path = os.path.join(directory, "plain.pt")
        saved = _timed(lambda: torch.save(payload, path))
        loaded = _timed(lambda: _into(targets, torch.load(path, map_location="cpu",
                                                          weights_only=True)["model"]))
        os.unlink(path)
        return saved, loaded

    def synced() -> tuple[float, float]:
        path = os.path.join(directory, "synced.pt")

        def save() -> None:
            with open(path, "wb") as handle:
                torch.save(payload, handle)
                handle.flush()
                os.fsync(handle.fileno())

        saved = _timed(save)
        os.unlink(path)
        return saved, 0.0

    _report("file", _median_pairs(rounds, {"verified": verified, "plain": plain,
                                           "synced": synced}),
            megabytes * (1 << 20) / 1e9)


def sharded(megabytes: int, rounds: int, directory: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = _state(megabytes)
    targets = {"model": {key: torch.empty_like(value) for key, value in state.items()}}
    files = CheckpointFiles(directory)

    def verified() -> tuple[float, float]:
        name = "epoch=0000-step=00000001.dcp"
        saved = _timed(lambda: files.write({"hookloop": file_meta("best"), "model": state},
                                           name, shards=True))
        path = files.path(name)
        loaded = _timed(lambda: shard_files.read_directory(path, "cpu")[SHARDS]
                        .read_into(targets))
        shutil.rmtree(path)
        return saved, loaded

    def plain() -> tuple[float, float]:
        path = os.path.join(directory, "plain.dcp")
        saved = _timed(lambda: dcp.save({"model": state},
                                        storage_writer=dcp.FileSystemWriter(path)))
        loaded = _timed(lambda: dcp.load(targets, storage_reader=dcp.FileSystemReader(path)))
        shutil.rmtree(path)
        return saved, loaded

    _report("sharded", _median_pairs(rounds, {"verified": verified, "plain": plain}),
            megabytes * (1 << 20) / 1e9)


class _Probe(Callback):
    def __init__(self, marks: list[float]) -> None:
        self.marks = marks

    def on_batch_end(self, loop: Loop) -> None:
        self.marks.append(time.perf_counter())


def blocked(megabytes: int, rounds: int, directory: str, every: int = 6, saves: int = 4
            ) -> None:
    """The loop's wait per async save against one host copy, and the step time while a
    save runs against the step time without one."""
    width = max(8, int((megabytes * (1 << 20) / 4 / 3 / 2) ** 0.5))  # weights + 2 moments
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [(torch.randn(8, width), torch.randn(8, width)) for _ in range(saves * every)]
    waits: list[float] = []
    copies: list[float] = []
    busy: list[float] = []
    quiet: list[float] = []
    for index in range(rounds):
        before: list[float] = []
        after: list[float] = []
        checkpoint = Checkpoint(os.path.join(directory, f"run{index}"), every_n_steps=every,
                                every_n_epochs=None, keep_last=1, async_save=True)
        loop = Loop(model, optimizer, batches, loss_fn=F.mse_loss, device="cpu",
                    sanity_val_batches=0,
                    callbacks=[_Probe(before), checkpoint, _Probe(after)])
        loop.fit(1)
        for step in range(every, saves * every + 1, every):
            waits.append(after[step - 1] - before[step - 1])
            if step + 1 < len(after):  # the step after a save: its write is in flight
                busy.append(before[step] - after[step - 1])
            quiet.append(before[step - 2] - after[step - 3])  # a step with no write
        tensors = {**model.state_dict(), **{f"{key}.{name}": value for key, entry in
                                            optimizer.state_dict()["state"].items()
                                            for name, value in entry.items()
                                            if isinstance(value, torch.Tensor)}}
        copies.append(_timed(lambda: {key: value.detach().to("cpu", copy=True)
                                      for key, value in tensors.items()}))
    size = sum(value.numel() * value.element_size() for value in tensors.values()) / 1e9
    wait, copy = statistics.median(waits), statistics.median(copies)
    print(f"blocked: state {size:.3f} GB, wait per async save {wait * 1e3:.1f} ms, one host "
          f"copy {copy * 1e3:.1f} ms: {wait / copy:.3f}x")
    print(f"blocked: step {statistics.median(quiet) * 1e3:.1f} ms without a save, "
          f"{statistics.median(busy) * 1e3:.1f} ms while one is written: "
          f"{statistics.median(busy) / statistics.median(quiet):.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parts", nargs="+", default=["blocked", "file", "sharded"],
                        choices=["blocked", "file", "sharded"])
    options = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    print(f"{os.cpu_count()} CPU(s), {options.rounds} round(s), medians")
    parts = {"blocked": blocked, "file": single_file, "sharded": sharded}
    for part in options.parts:
        with tempfile.TemporaryDirectory() as directory:
            parts[part](options.mb, options.rounds, directory)


if __name__ == "__main__":
    main()
