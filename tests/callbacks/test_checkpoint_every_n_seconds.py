"""``Checkpoint(every_n_seconds=...)`` (issue 28, item 6; Lightning's ``train_time_interval``).

The clock is the callback's own (``hookloop.parallel.suspension.time.monotonic``), replaced here by a
clock that a callback advances by 10 s at every training batch, so which steps save is
exact: with ``every_n_seconds=15`` the time is up at step 2 (20 s), the save comes at the
next agreed step boundary (step 3), the clock counts from there, and so on. No wall time
is measured. The two-rank agreement is in tests/distributed/test_day_one_two_processes.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import Checkpoint

from builders import dropout_loop


class FakeClock(Callback):
    """Time advances by ``tick`` seconds at every training batch (before Checkpoint's turn)."""

    def __init__(self, tick: float = 10.0) -> None:
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        return self.now

    def on_batch_end(self, loop: Loop) -> None:
        self.now += self.tick


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr("hookloop.parallel.suspension.time.monotonic", clock)
    return clock


def steps_on_disk(directory: Path) -> list[int]:
    return sorted(int(path.stem.split("step=")[1]) for path in directory.glob("epoch=*.pt"))


def test_saves_come_every_n_seconds_at_the_next_boundary(tmp_path: Path, clock: FakeClock) -> None:
    checkpoint = Checkpoint(tmp_path, every_n_epochs=None, keep_last=None, every_n_seconds=15)
    loop = dropout_loop([clock, checkpoint], batches=6)
    loop.fit(2)
    assert steps_on_disk(tmp_path) == [3, 6, 9, 12]  # 12 is also the last epoch's end
    assert checkpoint.every_n_seconds == 15.0


def test_a_slow_step_does_not_save_twice_and_a_resume_is_exact(tmp_path: Path,
                                                               clock: FakeClock) -> None:
    clock.tick = 100.0  # every step alone is past the interval
    loop = dropout_loop([clock, Checkpoint(tmp_path, every_n_epochs=None, keep_last=None,
                                           every_n_seconds=15)], batches=6)
    loop.fit(1)
    # asked at step 1, saved at 2 (the clock restarts), asked at 3, saved at 4, ...
    assert steps_on_disk(tmp_path) == [2, 4, 6]
    uninterrupted = dropout_loop(batches=6)
    uninterrupted.fit(2)
    (tmp_path / "epoch=0000-step=00000006.pt").unlink()  # resume from step 4, mid-epoch
    resumed = dropout_loop([Checkpoint(tmp_path, resume=True)], batches=6)
    resumed.fit(2)
    for key, value in uninterrupted.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key


def test_every_n_seconds_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="every_n_seconds"):
        Checkpoint("unused", every_n_seconds=0)
    with pytest.raises(ConfigurationError, match="every_n_seconds"):
        Checkpoint("unused", every_n_seconds="10")
