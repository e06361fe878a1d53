"""torchrun script: a 2-rank FSDP run whose sharded checkpoints go to ``s3://`` (moto on
localhost), for tests/distributed/test_remote_sharded_processes.py.

Usage: torchrun --nproc_per_node=2 remote_sharded.py OUT_DIR URL ENDPOINT LABEL

LABEL ``reference``: 40 epochs (160 steps) without checkpoints; else:
``Checkpoint(URL, every_n_steps=1, keep_last=2, resume=True)`` over a staging directory in
OUT_DIR (the test kills it at random moments and relaunches it). Both save the gathered
weights as ``LABEL-weights``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from common import FEATURES, out_dir, rank, regression_data, save, shuffled_loader
from fsdp import gathered, make_optimizer
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import FSDP, Checkpoint

EPOCHS, KEEP = 40, 2


def make_model(seed: int) -> nn.Module:
    """~0.3M parameters (odd row counts, so the shards are uneven): with AdamW's moments a
    save is ~3.5 MB in about ten objects, so an upload lasts long enough to be killed in."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 511), nn.Tanh(), nn.Linear(511, 511), nn.Tanh(),
                         nn.Linear(511, 1))


class Compute(Callback):
    """50 ms per step outside the GIL, as a GPU step leaves the host thread waiting: the tiny
    model alone trains 160 steps in about a second, before most uploads could begin."""

    def on_batch_end(self, loop: Loop) -> None:
        time.sleep(0.05)


def main() -> None:
    out = out_dir()
    url, endpoint, label = sys.argv[2:5]
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    callbacks: list[Callback] = [FSDP(state_dict="sharded"), Compute()]
    if label != "reference":
        callbacks.append(Checkpoint(url, every_n_steps=1, keep_last=KEEP, resume=True,
                                    staging_dir=str(out / "staging"), storage_options={
                                        "client_kwargs": {"endpoint_url": endpoint}}))
    model = make_model(seed=7)
    loop = Loop(model, make_optimizer(model),
                shuffled_loader(regression_data(32, seed=8), 4, seed=9),
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=callbacks)
    loop.fit(EPOCHS)
    weights = gathered(loop.unwrapped_model)
    if rank() == 0:
        save(f"{label}-weights", weights)


if __name__ == "__main__":
    main()
