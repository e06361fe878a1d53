"""torchrun script: the integrity of sharded checkpoints on 2 ranks (FSDP, gloo), for
tests/distributed/test_checkpoint_integrity.py. One launch serves every assertion.

Usage: torchrun --nproc_per_node=2 integrity.py OUT_DIR

1. the uninterrupted reference: 2 epochs of 4 steps, sharded checkpoints every 2 steps;
2. for a synchronous and an async (``async_save=True``) run: the disk fills (rank 1's
   shard write raises ENOSPC) at the save of step 4; each rank records the error it got and
   the bytes of the earlier checkpoints before and after; then a relaunch (a new loop,
   ``resume=True``, the disk free again) trains to the end;
3. a hostile ``.metadata`` (a pickle that would create a file) in a copy of the reference's
   last checkpoint: ``Checkpoint(resume=True)`` and ``hookloop.load_checkpoint`` on each rank.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import shutil
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import out_dir, rank, regression_data, save, shuffled_loader
from fsdp import gathered, make_model, make_optimizer
from torch import nn

from hookloop import Callback, CheckpointError, Loop, load_checkpoint
from hookloop.callbacks import FSDP, Checkpoint

FULL = [False]


def _full_disk() -> None:
    """Rank 1's writes of shard data fail with ENOSPC while ``FULL[0]``."""
    import torch.distributed.checkpoint.filesystem as filesystem

    original = filesystem._write_item

    def write_item(*args: Any, **kwargs: Any) -> Any:
        if FULL[0] and rank() == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(*args, **kwargs)

    filesystem._write_item = write_item  # type: ignore[assignment]


def _bytes_of(directory: Path) -> dict[str, str]:
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()
            and path.name != ".hookloop.lock"}


class DiskFillsAt(Callback):
    """At step ``step`` (before Checkpoint saves it): the disk is full from now on, and
    what the directory holds is recorded, once the earlier save is complete (an async one
    may still be writing step 2's shards under a temporary name: on a loaded machine it
    outlasts two steps, and the disk filling under it would fail that save instead)."""

    def __init__(self, step: int, directory: Path, seen: dict[str, Any],
                 checkpoint: Checkpoint) -> None:
        self.step, self.directory, self.seen = step, directory, seen
        self.checkpoint = checkpoint

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step_boundary and loop.state.step == self.step and not FULL[0]:
            self.checkpoint._writes.wait()  # every rank: the write in flight is collective
            self.seen["before"] = _bytes_of(self.directory)
            FULL[0] = True


def run(directory: Path, *, async_save: bool = False, fill_at: int | None = None,
        seen: dict[str, Any] | None = None) -> Loop:
    model = make_model(seed=7)
    callbacks: list[Callback] = [FSDP(state_dict="sharded")]
    checkpoint = Checkpoint(directory, every_n_steps=2, resume=True, keep_last=None,
                            async_save=async_save)
    if fill_at is not None:
        assert seen is not None
        callbacks.append(DiskFillsAt(fill_at, directory, seen, checkpoint))
    callbacks.append(checkpoint)
    loop = Loop(model, make_optimizer(model),
                shuffled_loader(regression_data(32, seed=8), 4, seed=9),
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=callbacks)
    loop.fit(2)
    return loop


def full_disk(out: Path, label: str, async_save: bool) -> None:
    directory = out / label
    seen: dict[str, Any] = {}
    try:
        run(directory, async_save=async_save, fill_at=4, seen=seen)
        seen["error"] = None
    except BaseException as error:  # noqa: BLE001 - what each rank got is the result
        seen["error"] = {"class": type(error).__name__, "message": str(error),
                         "trace": traceback.format_exc()[-3000:]}
    FULL[0] = False
    dist.barrier()
    seen["after"] = _bytes_of(directory)
    save(f"{label}-seen", seen)
    dist.barrier()
    loop = run(directory, async_save=async_save)  # the relaunch, the disk free again
    weights = gathered(loop.unwrapped_model)
    if rank() == 0:
        save(f"{label}-weights", weights)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def hostile(out: Path) -> None:
    directory = out / "hostile"
    marker = out / "pwned"
    if rank() == 0:
        newest = sorted((out / "reference").glob("epoch=*.dcp"))[-1]
        shutil.copytree(newest, directory / newest.name)
        (directory / newest.name / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    dist.barrier()
    found: dict[str, Any] = {}
    for how in ("resume", "load_checkpoint"):
        try:
            if how == "resume":
                run(directory)
            else:
                load_checkpoint(next(directory.glob("epoch=*.dcp")), make_model(seed=1))
            found[how] = None
        except CheckpointError as error:
            found[how] = str(error)
        dist.barrier()
    found["marker"] = marker.exists()
    save("hostile", found)


def main() -> None:
    dist.init_process_group("gloo")  # FSDP uses it and leaves it: several fits in a launch
    out = out_dir()
    _full_disk()
    loop = run(out / "reference")
    weights = gathered(loop.unwrapped_model)
    if rank() == 0:
        save("reference-weights", weights)
    full_disk(out, "sync", async_save=False)
    full_disk(out, "async", async_save=True)
    hostile(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
