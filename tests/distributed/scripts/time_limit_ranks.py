"""torchrun script: ``TimeLimit()`` in a SLURM job on 2 ranks (issue 33, items 11 and 12).

Usage: torchrun --nproc_per_node=2 time_limit_ranks.py OUT BIN MODE

BIN holds the test's stand-in ``squeue`` (and ``scontrol``): it goes first on PATH, and the
process is in SLURM job 4242 without ``SLURM_JOB_END_TIME``, so ``TimeLimit()`` must ask.

- ``ask``: a fit with ``TimeLimit()``; every rank saves its ``duration`` after construction
  and after the fit. Then a fit without a Checkpoint whose budget is spent on rank 1 only:
  every rank saves the step it ended at (the script goes on: no exit status 75).
- ``fail``: squeue fails (for rank 0); every rank saves when it started and the error it
  ends with, then lets it end the process.
"""

from __future__ import annotations

import os
import sys
import time

from torch import nn

from common import make_model, make_optimizer, rank, regression_data, save, shuffled_loader
from hookloop import ConfigurationError, Loop
from hookloop.callbacks import DDP, TimeLimit


def build(limit: TimeLimit) -> Loop:
    model = make_model(0)
    return Loop(model, make_optimizer(model), shuffled_loader(regression_data(24, seed=2), 3, 3),
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=[DDP(), limit])


def ask() -> None:
    limit = TimeLimit()
    save("constructed", {"duration": limit.duration})
    build(limit).fit(1)
    save("asked", {"duration": limit.duration})
    capped = TimeLimit(1e-6 if rank() == 1 else 3600.0, start="created")
    loop = build(capped)
    state = loop.fit(3)
    save("capped", {"step": state.step, "resumable": loop.stop_resumable})


def fail() -> None:
    save("started", {"time": time.time()})
    try:
        build(TimeLimit()).fit(1)
    except ConfigurationError as error:
        save("error", {"type": type(error).__name__, "message": str(error), "time": time.time()})
        raise


if __name__ == "__main__":
    # Here, not at import: pytest imports every module under tests/ for its doctests, and
    # these would put this process in a SLURM job for the rest of the suite.
    os.environ["PATH"] = sys.argv[2] + os.pathsep + os.environ.get("PATH", "")
    os.environ["SLURM_JOB_ID"] = "4242"
    os.environ.pop("SLURM_JOB_END_TIME", None)
    {"ask": ask, "fail": fail}[sys.argv[3]]()
