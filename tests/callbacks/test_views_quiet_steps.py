"""The views cost no call on a batch where their settings leave nothing to do: TensorBoard
without ``graph`` is not called at ``on_batch_start``, CSVLogger without ``every_n_steps``
not at ``after_step`` (the dispatch table leaves them out), and the events they do need
are still called (every handler the table calls goes through the loop's
``handler_wrapper``, which a callback sets at setup, as `Profiler` does, to count them)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from hookloop import Callback, Loop
from hookloop.callbacks import CSVLogger, TensorBoard

from builders import classification_batches


def _calls(callbacks: list, tmp_path: Path) -> Counter:
    called: Counter = Counter()

    def wrap(callback, event, method):
        def wrapped(*args):
            called[type(callback).__name__, event] += 1
            return method(*args)
        wrapped.__self__, wrapped.__name__ = callback, event
        return wrapped

    class Count(Callback):
        def setup(self, loop: Loop) -> None:
            loop.handler_wrapper = wrap

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), classification_batches(4, seed=1),
         loss_fn=F.cross_entropy, device="cpu", callbacks=[Count(), *callbacks]).fit(1)
    return called


def test_views_are_not_called_where_their_settings_leave_nothing_to_do(tmp_path: Path) -> None:
    called = _calls([TensorBoard(str(tmp_path / "tb"), every_n_steps=2),
                     CSVLogger(os.path.join(tmp_path, "log.csv"))], tmp_path)
    assert called["TensorBoard", "on_batch_start"] == 0
    assert called["CSVLogger", "after_step"] == 0
    assert called["TensorBoard", "after_step"] == 4 and called["CSVLogger", "on_epoch_end"] == 1


def test_views_are_called_where_their_settings_need_it(tmp_path: Path) -> None:
    called = _calls([TensorBoard(str(tmp_path / "tb"), graph=True),
                     CSVLogger(os.path.join(tmp_path, "log.csv"), every_n_steps=2)], tmp_path)
    assert called["TensorBoard", "on_batch_start"] == 4
    assert called["CSVLogger", "after_step"] == 4


def test_a_subclass_overriding_a_quiet_event_is_called_and_a_setting_changed_mid_fit_holds(
        tmp_path: Path) -> None:
    """Found in review: the silent events were inherited, so a subclass's own
    ``on_batch_start``/``after_step`` was never called; and CSVLogger asserted when its
    ``every_n_steps`` was set to None during a fit."""
    seen: Counter = Counter()

    class MyBoard(TensorBoard):
        def on_batch_start(self, loop: Loop) -> None:
            seen["board"] += 1
            super().on_batch_start(loop)

    class MyCSV(CSVLogger):
        def after_step(self, loop: Loop) -> None:
            seen["csv"] += 1
            super().after_step(loop)

    _calls([MyBoard(str(tmp_path / "tb")), MyCSV(tmp_path / "log.csv")], tmp_path)
    assert seen == {"board": 4, "csv": 4}

    csv = CSVLogger(tmp_path / "every.csv", every_n_steps=1)

    class Quieten(Callback):
        def on_epoch_start(self, loop: Loop) -> None:
            if loop.state.epoch == 1:
                csv.every_n_steps = None

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), classification_batches(4, seed=1),
         loss_fn=F.cross_entropy, device="cpu", callbacks=[Quieten(), csv]).fit(2)
