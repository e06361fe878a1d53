"""One training run whose views write to a disk that may fill up (a fresh process each).

    python full_log_disk.py OUT_DIR LOG_DIR [--views csv,tensorboard] [--resume]
        [--capacity BYTES]

The views write under LOG_DIR (``LOG_DIR/log.csv``, ``LOG_DIR/tb``), the checkpoints under
OUT_DIR/ckpt (another disk). ``--capacity`` makes LOG_DIR a disk of that many bytes: every
file opened for writing under it (by ``open``/``io.open``, which CSVLogger and tensorboard's
event writer use, with a name as str, bytes or path) writes what still fits and then fails with ENOSPC, as a full disk does.
Without it the disk is the real one (a small tmpfs in the tests that can mount one).

Writes OUT_DIR/result.json: the step the run reached, and how it ended (the error's class
and message); and OUT_DIR/weights.pt, the final weights. Exits 1 when fit raised.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import errno
import io
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookloop import Loop
from hookloop.callbacks import Checkpoint, CSVLogger, TensorBoard

EPOCHS, BATCHES = 4, 12


class SmallDisk:
    """Files opened for writing under ``root`` share ``capacity`` bytes."""

    def __init__(self, root: str, capacity: int) -> None:
        self.root, self.capacity = os.path.abspath(root), capacity
        self.real_open = builtins.open

    def used(self) -> int:
        total = 0
        for folder, _, names in os.walk(self.root):
            for name in names:
                # A view's temporary file may be renamed or removed between the listing and
                # the size (the writer threads write while the loop writes): it takes no room.
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(folder, name))
        return total

    def open(self, file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None,
             errors: str | None = None, newline: str | None = None, *args: Any,
             **kwargs: Any) -> Any:
        writing = any(flag in mode for flag in "wax+")
        if not writing or not isinstance(file, (str, bytes, os.PathLike)) \
                or not os.path.abspath(os.fsdecode(file)).startswith(self.root + os.sep):
            return self.real_open(file, mode, buffering, encoding, errors, newline,
                                  *args, **kwargs)
        raw = self.real_open(file, mode.replace("t", "").replace("b", "") + "b", buffering=0)
        buffered = io.BufferedWriter(Limited(raw, self))
        if "b" in mode:
            return buffered
        return io.TextIOWrapper(buffered, encoding=encoding or "utf-8", errors=errors,
                                newline=newline)


class Limited(io.RawIOBase):
    """A file on a `SmallDisk`: a write gets what still fits, then ENOSPC."""

    def __init__(self, raw: io.FileIO, disk: SmallDisk) -> None:
        self.raw, self.disk = raw, disk

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        data = bytes(data)
        room = self.disk.capacity - self.disk.used()
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.raw.write(data[:room])

    def close(self) -> None:
        self.raw.close()
        super().close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("logs")
    parser.add_argument("--views", default="csv")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--capacity", type=int)
    args = parser.parse_args()
    out, logs = Path(args.out), Path(args.logs)
    if args.capacity is not None:
        disk = SmallDisk(str(logs), args.capacity)
        builtins.open = io.open = disk.open  # type: ignore[assignment]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    data = [(torch.randn(4, 6), torch.randn(4, 1)) for _ in range(BATCHES)]
    callbacks: list[Any] = []
    views = args.views.split(",")
    if "csv" in views:
        callbacks.append(CSVLogger(logs / "log.csv", every_n_steps=1))
    if "tensorboard" in views:
        callbacks.append(TensorBoard(logs / "tb", every_n_steps=1))
    callbacks.append(Checkpoint(out / "ckpt", resume=args.resume))
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), data, val_data=data[:3],
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=callbacks,
                sanity_val_batches=0)
    result: dict[str, Any] = {}
    try:
        loop.fit(EPOCHS)
    except Exception as error:  # noqa: BLE001 - reported in result.json, then re-raised as exit 1
        result["error"] = type(error).__name__
        result["message"] = str(error)
        result["notes"] = list(getattr(error, "__notes__", []))
        traceback.print_exc()
    result["step"] = loop.state.step
    torch.save(model.state_dict(), out / "weights.pt")
    (out / "result.json").write_text(json.dumps(result))
    raise SystemExit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
