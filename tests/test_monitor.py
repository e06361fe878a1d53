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


# ------------------------------------------------ a mode against the name (issue 25, item 16)
@pytest.mark.parametrize(("make", "owner", "metric", "mode", "named"), [
    (lambda: EarlyStopping(monitor="val_acc", mode="min"), "EarlyStopping", "val_acc", "min", "max"),
    (lambda: EarlyStopping(monitor="val_loss", mode="max"), "EarlyStopping", "val_loss", "max", "min"),
    (lambda: Checkpoint("unused", monitor="val_f1", mode="min"), "Checkpoint", "val_f1", "min", "max"),
])
def test_a_mode_that_contradicts_the_metrics_name_warns_with_the_way_to_silence_it(
        make, owner: str, metric: str, mode: str, named: str) -> None:
    with pytest.warns(UserWarning, match=rf"{owner} monitors '{metric}' with mode='{mode}', "
                                         rf"but the name says .*pass mode='{named}'.*"
                                         r"warnings\.filterwarnings\('ignore'") as caught:
        make()
    assert caught[0].filename == __file__  # it points at the line that created the callback
    import warnings

    message = str(caught[0].message)
    silence = message[message.index("warnings.filterwarnings("):message.index(") before")+1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eval(silence, {"warnings": warnings})  # the filter the message gives, as given
        make()  # silenced: no warning, no error


@pytest.mark.parametrize("make", [
    lambda: EarlyStopping(monitor="val_acc", mode="max"),
    lambda: EarlyStopping(monitor="val_acc"),
    lambda: EarlyStopping(monitor="val_score", mode="min"),  # the name says nothing
])
def test_a_mode_that_agrees_or_a_name_that_says_nothing_does_not_warn(make) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make()
