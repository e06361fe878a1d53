"""Monitor (hookloop/monitor.py), the one helper behind every callback that watches a metric:
mode="auto" reads the metric's name, and a name that says nothing needs an explicit mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import Checkpoint, EarlyStopping

from builders import ScriptedMetric, SeenSamples, shuffled_run


def test_val_acc_is_maximised_by_default(tmp_path: Path) -> None:
    rising = ScriptedMetric([0.5, 0.6, 0.7, 0.8, 0.9], "val_acc", by="order")
    model, loop = shuffled_run([rising, EarlyStopping("val_acc", patience=1),
                                Checkpoint(tmp_path, monitor="val_acc")])
    loop.val_data = loop.train_data
    loop.fit(5)
    assert not loop.stop_requested and loop.state.epoch == 4
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["hookloop"]["value"] == 0.9 and best["epoch"] == 4


@pytest.mark.parametrize("name", ["val_score", "custom"])
def test_a_name_that_says_nothing_needs_an_explicit_mode(name: str) -> None:
    class Score(Callback):
        def produces(self, loop: Loop) -> list[str]:
            return [name]

    seen = SeenSamples()
    _, loop = shuffled_run([seen, Score(), EarlyStopping(name)])
    with pytest.raises(ConfigurationError, match="mode='max'.*mode='min'"):
        loop.fit(1)
    assert seen.batches == []
