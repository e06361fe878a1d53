"""A kill between best.pt's write (on_validation_end) and the rotating file of the same epoch
(on_epoch_end): resume=True restarts from the older rotating file, whose state holds an older
best, and the replayed validation must not overwrite the better best.pt on disk with a worse
one."""
from __future__ import annotations

import os
import shutil
import warnings

import torch

from hookloop import Callback
from hookloop.callbacks import Checkpoint

from builders import ScriptedMetric, net_batches, net_loop


class KillAfterValidation(Callback):
    """Copies the directory at on_validation_end of `epoch`, after Checkpoint wrote best.pt."""

    def __init__(self, src, dst, epoch):
        self.src, self.dst, self.epoch = src, dst, epoch

    def on_validation_end(self, loop):
        if not loop.sanity_checking and loop.state.epoch == self.epoch \
                and not os.path.exists(self.dst):
            shutil.copytree(self.src, self.dst)


def test_resume_never_replaces_best_pt_with_a_worse_score(tmp_path) -> None:
    """The resumed run's replayed validation (0.47) keeps the better best.pt (0.45)."""
    first = [0.9, 0.5, 0.7, 0.45, 0.8]
    net_loop([ScriptedMetric(first, by="history", at_sanity=0.0),
              Checkpoint(tmp_path / "a", monitor="val_score", mode="min"),
              KillAfterValidation(tmp_path / "a", tmp_path / "b", 3)],
             batch_norm=True, val=net_batches(2, seed=7)).fit(5)
    on_disk = torch.load(tmp_path / "b" / "best.pt", weights_only=True)["hookloop"]["value"]
    assert on_disk == 0.45  # the killed run had reached 0.45; newest rotating file: epoch 2
    # The replay of epoch 3 scores a little worse (GPU non-determinism, workers, ...).
    replay = [0.9, 0.5, 0.7, 0.47, 0.8]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net_loop([ScriptedMetric(replay, by="history", at_sanity=0.0),
                  Checkpoint(tmp_path / "b", monitor="val_score", mode="min", resume=True)],
                 batch_norm=True, val=net_batches(2, seed=7)).fit(5)
    after = torch.load(tmp_path / "b" / "best.pt", weights_only=True)["hookloop"]["value"]
    assert after == 0.45
