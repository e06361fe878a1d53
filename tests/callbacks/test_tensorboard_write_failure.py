"""TensorBoard's writer failing where a checkpoint asks for its state: the flush inside
``state_dict`` fails, the checkpoint is written all the same, and the failure is raised,
named, at TensorBoard's next write. (Full disks across launches:
tests/across_launches/test_full_log_disk_keeps_checkpoint.py.)"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter

from hookloop import Callback, LogWriteError, Loop
from hookloop.callbacks import Checkpoint, TensorBoard


class FullDiskAtEpochEnd(Callback):
    """From the end of epoch 0 on (before Checkpoint saves), every flush of a writer fails."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def on_epoch_end(self, loop: Loop) -> None:
        def full(writer: SummaryWriter) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        self.monkeypatch.setattr(SummaryWriter, "flush", full)


def test_a_flush_failing_for_a_checkpoint_fails_neither_it_nor_silently(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(3, 4), torch.randint(0, 2, (3,))) for _ in range(4)]
    board = TensorBoard(tmp_path / "tb", every_n_steps=1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
                device="cpu", callbacks=[board, FullDiskAtEpochEnd(monkeypatch),
                                         Checkpoint(tmp_path / "ckpt", keep_last=5)])
    with pytest.raises(LogWriteError, match=r"TensorBoard could not write .*events\.out\.tfevents"
                                            r".*: no space left on the device") as raised:
        loop.fit(2)
    # The epoch-end checkpoint took TensorBoard's state while its flush failed: written; and
    # so is the one taken on the way out, at the step the run reached.
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == [
        "epoch=0000-step=00000004.pt", "epoch=0001-step=00000005.pt"]
    # Raised at TensorBoard's next write (the first step of epoch 1), once.
    notes = raised.value.__notes__
    assert notes[0] == "hookloop: raised in callback TensorBoard at event after_step"
    assert loop.state.step == 5 and len(notes) == 1
    assert board._writer is None  # closed all the same



_THREAD_FAILS = """
import errno, os, sys, torch
import torch.nn.functional as F
from tensorboard.summary.writer import record_writer
from hookloop import Callback, LogWriteError, Loop
from hookloop.callbacks import TensorBoard

class FullDiskAfterFirstEpoch(Callback):
    def on_epoch_end(self, loop):
        def full(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        record_writer.RecordWriter.write = full

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
data = [(torch.randn(3, 4), torch.randint(0, 2, (3,))) for _ in range(4)]
loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
            device="cpu", callbacks=[TensorBoard(sys.argv[1], every_n_steps=1),
                                     FullDiskAfterFirstEpoch()])
try:
    loop.fit(3)
except LogWriteError as error:
    print("raised:", error, file=sys.stderr)
"""


@pytest.mark.slow
def test_the_writer_thread_prints_no_traceback_of_its_own_before_the_log_write_error(
        tmp_path: Path) -> None:
    """A full disk under tensorboard's event-writer thread, in a process of its own (pytest
    replaces the hook that prints a thread's exception): stderr holds hookloop's
    LogWriteError and no raw OSError traceback of that thread."""
    import subprocess
    import sys

    from conftest import subprocess_env

    result = subprocess.run([sys.executable, "-c", _THREAD_FAILS, str(tmp_path / "tb")],
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "raised: TensorBoard could not write" in result.stderr
    assert "no space left on the device" in result.stderr
    assert "Traceback" not in result.stderr and "Exception in thread" not in result.stderr, \
        result.stderr[-3000:]
