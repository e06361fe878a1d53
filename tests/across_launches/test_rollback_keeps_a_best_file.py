"""A rollback keeps a best.pt for the new branch, with save_top_k=1 too."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from hookloop.callbacks import Checkpoint

from builders import ScriptedMetric, net_batches, net_loop

FIRST = [0.9, 0.5, 0.7, 0.45, 0.8, 0.85, 0.3, 0.9]   # best.pt reached at step 28 (epoch 6)
SECOND = [0.9, 0.5, 0.7, 0.45, 0.8, 0.6, 0.6, 0.6]   # the new branch after epoch 4


@pytest.mark.parametrize("k", [1, 2])
def test_a_rollback_keeps_a_best_file(tmp_path, k: int) -> None:
    def stack(values, resume=False):
        return [ScriptedMetric(values, by="history", at_sanity=0.0),
                Checkpoint(tmp_path, monitor="val_score", mode="min", save_top_k=k,
                           keep_last=None, resume=resume)]
    net_loop(stack(FIRST), batch_norm=True, val=net_batches(2, seed=7)).fit(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        branch = net_loop(stack(SECOND, resume=str(tmp_path / "epoch=0004-step=00000020.pt")),
                          batch_norm=True, val=net_batches(2, seed=7))
        branch.fit(8)
    checkpoint = branch.callbacks[1]
    # The new branch validated 8 times with monitor set: it must have a best file. With k=2
    # the 0.45 validation kept its own file, and best.pt is linked to it again. With k=1
    # the abandoned branch's better best.pt replaced it, but its weights were set aside
    # while the rotating files of steps 16 to 28 ranked it: best.pt is 0.45 again.
    assert checkpoint.best == 0.45
    assert checkpoint.best_path is not None and os.path.isfile(tmp_path / "best.pt")
    saved = torch.load(tmp_path / "best.pt", weights_only=True)
    assert saved["hookloop"]["value"] == checkpoint.best
