"""Checkpoint under interrupts: Ctrl-C (on_exception, on_fit_end, a resumable checkpoint, a
second Ctrl-C during the save), an interrupt inside a routine save, and SIGKILL at random
moments while checkpoints are being written."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hookloop import Callback, Loop
import hookloop
from hookloop.callbacks import Checkpoint
from hookloop.runfile import checkpoint_files as checkpoint_module  # where Checkpoint's writes go
from hookloop.runfile import storage

from builders import EventRecorder, adam, regression_batches
from builders import make_loop as build_loop
from kill_campaign import campaign


#: The events a recorder is checked for here: the exception path and the end of the fit.
ENDS = ("on_exception", "on_fit_end")


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return regression_batches(5, seed=0)


def hand_written(epochs: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(epochs):
        for inputs, targets in batches():
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


class CtrlC(Callback):
    """Delivers a real SIGINT to this process in the forward of ``(epoch, batch)``."""

    def __init__(self, epoch: int, batch: int) -> None:
        self.at = (epoch, batch)

    def on_batch_start(self, loop: Loop) -> None:
        if (loop.state.epoch, loop.state.batch_idx) == self.at:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the KeyboardInterrupt is raised here


def make_loop(directory: Path, callbacks: list[Callback], resume: bool = False) -> Loop:
    return build_loop([Checkpoint(directory, resume=resume), *callbacks], train=batches(),
                      optimizer=adam(0.05))


def test_ctrl_c_leaves_a_resumable_checkpoint_and_propagates(tmp_path: Path) -> None:
    recorder = EventRecorder()
    loop = make_loop(tmp_path, [recorder, CtrlC(epoch=1, batch=2)])
    with pytest.raises(KeyboardInterrupt):
        loop.fit(3)
    assert recorder.labels(*ENDS) == ["on_exception:KeyboardInterrupt", "on_fit_end"]
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == ["epoch=0001-step=00000007.pt"]  # the last completed step (5 + 2)
    payload = torch.load(tmp_path / files[0], weights_only=True)
    assert payload["loop"]["step"] == 7 and payload["loop"]["batch_idx"] == 2
    resumed = make_loop(tmp_path, [], resume=True)
    resumed.fit(3)
    expected = hand_written(3)
    assert torch.equal(resumed.model.weight, expected.weight)
    assert torch.equal(resumed.model.bias, expected.bias)


def test_second_ctrl_c_during_the_save_aborts_at_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = EventRecorder()
    loop = make_loop(tmp_path, [recorder, CtrlC(epoch=1, batch=2)])
    real_save = torch.save

    def interrupted_save(obj: object, handle: object) -> None:
        real_save(obj, handle)
        handle.truncate(1000)  # type: ignore[attr-defined]  # half written...
        raise KeyboardInterrupt  # ...when the second Ctrl-C arrives

    class ArmSecondInterrupt(Callback):
        def on_exception(self, loop: Loop, exc: BaseException) -> None:
            pass

        def on_batch_start(self, loop: Loop) -> None:
            if (loop.state.epoch, loop.state.batch_idx) == (1, 2):
                monkeypatch.setattr(storage.torch, "save", interrupted_save)

    loop.callbacks.insert(1, ArmSecondInterrupt())
    with pytest.raises(KeyboardInterrupt):
        loop.fit(3)
    assert recorder.labels(*ENDS) == []  # aborted at once: nothing after the interrupted save
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == ["epoch=0000-step=00000005.pt"]  # the good file, no temporary left
    payload = torch.load(tmp_path / files[0], weights_only=True)
    assert payload["loop"]["step"] == 5


def test_other_exceptions_also_leave_a_checkpoint(tmp_path: Path) -> None:
    class Boom(Callback):
        def after_backward(self, loop: Loop) -> None:
            if loop.state.step == 3:
                raise ValueError("boom")

    recorder = EventRecorder()
    with pytest.raises(ValueError, match="boom"):
        make_loop(tmp_path, [recorder, Boom()]).fit(2)
    assert recorder.labels(*ENDS) == ["on_exception:ValueError", "on_fit_end"]
    assert [path.name for path in tmp_path.iterdir()] == ["epoch=0000-step=00000003.pt"]


# -------------------------------------------------------------------- SIGKILL
def test_sigkill_while_writing_checkpoints(tmp_path: Path) -> None:
    """At least 5 of 10 SIGKILLs (30 s), one while a save is written: no unreadable file,
    and the relaunch ends on the uninterrupted run's weights."""
    kills, killed_mid_write = campaign(tmp_path, epochs=3, async_save=False, kills=10,
                                       seconds=30, pause=0.25, join=120)
    assert kills >= 5
    assert killed_mid_write >= 1, "no kill landed in the middle of a save"


# ----------------------------------------------------- an interrupt inside a save


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, hookloop.Terminated])
def test_interrupt_during_a_routine_save_still_leaves_a_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: type[BaseException]) -> None:
    """An interrupt (Ctrl-C, or SIGTERM's Terminated) during a routine save: on_exception
    saves that position again, rather than take it for written."""
    real = checkpoint_module.write_atomic
    calls = []

    def interrupted_once(payload, path):
        calls.append(path)
        if len(calls) == 1:  # the signal arrives while torch.save runs
            raise interrupt()
        return real(payload, path)

    monkeypatch.setattr(checkpoint_module, "write_atomic", interrupted_once)
    loop = build_loop([Checkpoint(tmp_path)], train=regression_batches(4, seed=1))
    with pytest.raises(interrupt):
        loop.fit(2)
    # Oracle: the docs ("the exception path saves a resumable checkpoint") and an interrupt
    # at any other line, which leaves epoch=0000-step=00000004.pt.
    assert len(calls) == 2, f"on_exception did not retry the interrupted save: {calls}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0000-step=00000004.pt"]
