"""torchrun script: uploads to ``s3://`` (moto on localhost) that start failing on rank 0
mid-run are a named error on both ranks at one step, and the launch exits non-zero, for
tests/distributed/test_remote_sharded_processes.py.

Usage: torchrun --nproc_per_node=2 remote_upload_failure.py OUT_DIR URL ENDPOINT

A 2-rank FSDP run saves every step to URL; from step 3 on, every object rank 0 uploads is
refused (``PermissionError: Access Denied``, as a bucket policy denying writes answers).
Each rank saves what it raised (``error``: class, message, the step) and raises it again.
"""

from __future__ import annotations

import os
import sys

from common import out_dir, regression_data, save, shuffled_loader
from fsdp import make_optimizer
from remote_sharded import Compute, make_model
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import FSDP, Checkpoint
from hookloop.runfile.remote_store import RemoteStore

DENIED_FROM = 3


class DenyUploads(Callback):
    """From step `DENIED_FROM` on, the store refuses every object this process uploads."""

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step == DENIED_FROM:
            def refuse(store: RemoteStore, local: str, key: str) -> dict:
                raise PermissionError("Access Denied")

            RemoteStore._put = refuse  # type: ignore[method-assign]


def main() -> None:
    out = out_dir()
    url, endpoint = sys.argv[2:4]
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    checkpoint = Checkpoint(url, every_n_steps=1, keep_last=2, staging_dir=str(out / "staging"),
                            storage_options={"client_kwargs": {"endpoint_url": endpoint}})
    model = make_model(seed=7)
    loop = Loop(model, make_optimizer(model),
                shuffled_loader(regression_data(32, seed=8), 4, seed=9),
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[FSDP(state_dict="sharded"), Compute(), DenyUploads(), checkpoint])
    try:
        loop.fit(20)
    except Exception as error:
        save("error", {"class": type(error).__name__, "message": str(error),
                       "step": loop.state.step})
        raise
    save("error", None)


if __name__ == "__main__":
    main()
