"""Checkpoint under interrupts: Ctrl-C (on_exception, on_fit_end, a resumable checkpoint, a
second Ctrl-C during the save), an interrupt inside a routine save, and SIGKILL at random
moments while checkpoints are being written."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import hookloop
from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint
from hookloop import checkpoint_files as checkpoint_module  # where Checkpoint's writes go
from hookloop import storage
from hookloop.directory_lock import LOCK_NAME

from builders import EventRecorder, adam, regression_batches, regression_dataset, shuffled
from builders import make_loop as build_loop


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
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        loop.fit(3)
    assert time.perf_counter() - started < 5
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
TOTAL_STEPS = 60  # 20 batches x 3 epochs


def train_until_done(directory: str | None, out: str, started: object = None) -> None:
    """A training script, run in a child process; ``directory=None``: no checkpoints."""
    torch.set_num_threads(1)
    loader = shuffled(regression_dataset(160, features=256, seed=1), 8, seed=2)
    # ~1.3M parameters: with Adam's two moments a checkpoint is ~16 MB, slow enough (tens of
    # ms) to be killed in the middle of writing it.
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Dropout(0.2),
                             nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))

    class Started(Callback):
        def on_batch_end(self, loop: Loop) -> None:
            if started is not None:
                started.set()  # type: ignore[attr-defined]

    callbacks: list[Callback] = [Started()]
    if directory is not None:
        callbacks.insert(0, Checkpoint(directory, every_n_steps=1, keep_last=2, resume=True))
    loop = build_loop(callbacks, model=model, train=loader, optimizer=adam(1e-4))
    loop.fit(3)
    assert loop.state.step == TOTAL_STEPS
    torch.save(loop.model.state_dict(), out)


def check_directory(directory: Path) -> int:
    """Every file under a final name loads with weights_only=True; returns temp files seen."""
    temporary = 0
    for path in directory.iterdir():
        if path.name.startswith(".tmp-"):
            temporary += 1
            continue
        if path.name == LOCK_NAME:  # the killed job's lock file (the lock died with it)
            continue
        payload = torch.load(path, weights_only=True)
        assert payload["hookloop"]["kind"] == "resume", path
        storage.read_payload(path, "cpu")
    return temporary


def test_sigkill_while_writing_checkpoints(tmp_path: Path) -> None:
    """Children are forked from a forkserver that imported torch once, so each kill costs
    a fraction of a second instead of a fresh interpreter start."""
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo: imported by the first optimizer, seconds of each child otherwise
    context.set_forkserver_preload(["torch", "torch._dynamo", "hookloop.callbacks", __name__])
    directory = tmp_path / "checkpoints"
    rng = random.Random(0)
    deadline = time.monotonic() + 30
    kills = killed_mid_write = 0
    while kills < 10 and time.monotonic() < deadline:
        started = context.Event()
        child = context.Process(target=train_until_done,
                                args=(str(directory), str(tmp_path / "w.pt"), started))
        child.start()
        while not started.wait(0.05) and child.is_alive():
            pass
        if not child.is_alive():
            break  # it finished before we could kill it
        time.sleep(rng.uniform(0.0, 0.25))
        try:
            os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        except ProcessLookupError:  # it finished during the sleep; the forkserver reaped it
            break
        child.join(30)
        if child.exitcode == -signal.SIGKILL:
            kills += 1
            killed_mid_write += check_directory(directory) > 0
    assert kills >= 5
    assert killed_mid_write >= 1, "no kill landed in the middle of a save"
    # resume to the end, then compare with an uninterrupted run without checkpoints
    for target_directory, out in ((str(directory), "resumed.pt"), (None, "reference.pt")):
        child = context.Process(target=train_until_done, args=(target_directory, str(tmp_path / out)))
        child.start()
        child.join(120)
        assert child.exitcode == 0
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name
    assert check_directory(directory) == 0
    print(f"{kills} kills, {killed_mid_write} in the middle of a save")


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
