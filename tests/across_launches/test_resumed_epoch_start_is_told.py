"""``on_epoch_start`` fires again for an epoch resumed part-way, and a callback can tell:
``loop.position.resumed_mid_epoch`` (``batches_done > 0``) is True in it exactly then."""

from __future__ import annotations

from pathlib import Path

import pytest
from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint

from builders import RaiseAtBatch, make_loop, regression_batches


class EpochStarts(Callback):
    """Counts epochs once each (guarded), and records every on_epoch_start it hears."""

    def __init__(self) -> None:
        self.epochs, self.heard = 0, []

    def on_epoch_start(self, loop: Loop) -> None:
        position = loop.position
        self.heard.append((loop.state.epoch, position.batches_done, position.resumed_mid_epoch))
        if not position.resumed_mid_epoch:
            self.epochs += 1

    def state_dict(self) -> dict:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict) -> None:
        self.epochs = state["epochs"]


def test_fit_again_after_an_exception_fires_on_epoch_start_again_and_says_so() -> None:
    starts = EpochStarts()
    loop = make_loop(callbacks=[starts, RaiseAtBatch(1, 2, KeyboardInterrupt)])
    with pytest.raises(KeyboardInterrupt):
        loop.fit(3)
    loop.fit(3)
    assert starts.heard == [(0, 0, False), (1, 0, False), (1, 2, True), (2, 0, False)]
    assert starts.epochs == 3


def test_a_relaunch_from_a_mid_epoch_checkpoint_says_so(tmp_path: Path) -> None:
    def run(callbacks: list) -> Loop:
        return make_loop(train=lambda: regression_batches(6), callbacks=callbacks)

    first = EpochStarts()
    with pytest.raises(KeyboardInterrupt):
        run([first, RaiseAtBatch(1, 4, KeyboardInterrupt),
             Checkpoint(tmp_path, every_n_steps=1)]).fit(3)
    second = EpochStarts()
    run([second, Checkpoint(tmp_path, resume=True)]).fit(3)
    assert first.heard == [(0, 0, False), (1, 0, False)]
    assert second.heard == [(1, 4, True), (2, 0, False)]
    assert second.epochs == 3  # each of the three epochs counted once over both launches
