"""What the integrity digests of a sharded checkpoint cost, per GB saved and loaded.

A state of ``--mb`` MB of float32 tensors is written as a directory of shards (DCP, one
process) and read back into the same tensors, with hookloop's digests (each file's XXH3-128
recorded at the save, checked at the load) and, for the difference, with the recording
and the check left out. Runs alternate over ``--rounds``; medians are reported, and the
raw hash speed of SHA-256 and BLAKE2b (``hashlib``) and XXH3-128 (``xxhash``) on the same
bytes, from memory, which is why XXH3-128 is the digest of new saves (SHA-256, hookloop
0.1's, cost as much as DCP's whole write on 2 cores).

Usage:
    python benchmarks/checkpoint_digests.py [--mb 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import xxhash

from hookloop.runfile import integrity, shard_files
from hookloop.runfile.checkpoint_files import CheckpointFiles, file_meta
from hookloop.runfile.format import SHARDS


@contextmanager
def without_digests() -> Iterator[None]:
    """The save records no digest and the load checks none (the save id stays)."""
    record, check = shard_files._gathered_record, integrity.check_files
    shard_files._gathered_record = lambda *args, **kwargs: {}  # type: ignore[assignment]
    integrity.check_files = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        shard_files._gathered_record, integrity.check_files = record, check


def one_round(state: dict[str, torch.Tensor], directory: str) -> tuple[float, float]:
    files = CheckpointFiles(directory)
    name = "epoch=0000-step=00000001.dcp"
    started = time.perf_counter()
    path = files.write({"hookloop": file_meta("best"), "model": state}, name, shards=True)
    saved = time.perf_counter() - started
    assert path is not None
    targets = {"model": {key: torch.empty_like(value) for key, value in state.items()}}
    started = time.perf_counter()
    shard_files.read_directory(path, "cpu")[SHARDS].read_into(targets)
    loaded = time.perf_counter() - started
    shutil.rmtree(path)
    return saved, loaded


def hash_speed(data: bytes, algorithm: str) -> float:
    started = time.perf_counter()
    if algorithm == "xxh3_128":  # hookloop's content digest (hookloop.runfile.digests)
        xxhash.xxh3_128(data).digest()
    else:
        hashlib.new(algorithm, data).digest()
    return len(data) / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.manual_seed(0)
    pieces = 8
    state = {f"layer{index}.weight": torch.randn(options.mb * (1 << 20) // 4 // pieces)
             for index in range(pieces)}
    gigabytes = sum(value.numel() * 4 for value in state.values()) / 1e9
    times: dict[str, list[tuple[float, float]]] = {"with digests": [], "without": []}
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(options.rounds):
            times["with digests"].append(one_round(state, directory))
            with without_digests():
                times["without"].append(one_round(state, directory))
    medians = {label: (statistics.median(save for save, _ in runs),
                       statistics.median(load for _, load in runs))
               for label, runs in times.items()}
    print(f"state: {gigabytes:.3f} GB in {pieces} tensors, {options.rounds} round(s), "
          f"{os.cpu_count()} CPU(s)")
    for label, (save, load) in medians.items():
        print(f"{label:<13} save {save:7.3f} s   load {load:7.3f} s")
    save_cost = (medians["with digests"][0] - medians["without"][0]) / gigabytes
    load_cost = (medians["with digests"][1] - medians["without"][1]) / gigabytes
    print(f"digest cost per GB: save {save_cost:+.3f} s, load {load_cost:+.3f} s")
    data = b"".join(value.numpy().tobytes() for value in list(state.values())[:2])
    for algorithm in ("sha256", "blake2b"):
        print(f"hashlib {algorithm:<8} {hash_speed(data, algorithm):.2f} GB/s")
    print(f"xxhash  xxh3_128 {hash_speed(data, 'xxh3_128'):.2f} GB/s")


if __name__ == "__main__":
    main()
