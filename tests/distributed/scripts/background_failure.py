"""torchrun script: a background save that fails on rank 0 (DDP, gloo, single files) is a
named error on every rank at the same step, for tests/runfile/test_background_failures.py.

Usage: torchrun --nproc_per_node=2 background_failure.py OUT_DIR

Rank 0's writer thread fails to fsync the file of step 3 (EIO). A callback before
`Checkpoint` waits, on rank 0, for the write to be over at each step boundary (the step
outlasts the write), so the failure is known at the boundary of step 4. Each rank records
the error it got and the step where it came, then raises it: the launch exits non-zero.
"""

from __future__ import annotations

import errno
import os
import stat
import threading

from common import make_model, make_optimizer, out_dir, rank, regression_data, save, \
    shuffled_loader
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint
from hookloop.callbacks.ddp import DDP
from hookloop.runfile import storage


class WriteOver(Callback):
    def __init__(self) -> None:
        self.step = 0

    def on_batch_end(self, loop: Loop) -> None:
        for thread in threading.enumerate():
            if thread.name == "hookloop-checkpoint-writer":
                thread.join(timeout=60)
        self.step = loop.state.step


def main() -> None:
    out = out_dir()
    real = storage.os.fsync

    def fsync(descriptor: int) -> None:
        if threading.current_thread().name == "hookloop-checkpoint-writer" and \
                stat.S_ISREG(os.fstat(descriptor).st_mode) and probe.step >= 3:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(descriptor)

    storage.os.fsync = fsync  # type: ignore[assignment]
    probe = WriteOver()
    model = make_model(seed=3)
    loop = Loop(model, make_optimizer(model), shuffled_loader(regression_data(64, seed=4), 4,
                                                              seed=5),
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[DDP(), probe, Checkpoint(out / "ckpt", every_n_steps=1,
                                                   async_save=True)])
    try:
        loop.fit(1)
    except Exception as error:
        save("error", {"class": type(error).__name__, "message": str(error),
                       "step": loop.state.step, "rank": rank()})
        raise
    save("error", None)


if __name__ == "__main__":
    main()
