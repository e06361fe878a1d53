"""SIGKILL at random moments while checkpoints are written, then a relaunch to the end.

The checkpoint tests (synchronous and async writes) share this campaign: children are forked
from a forkserver that imported torch once, so each kill costs a fraction of a second
instead of a fresh interpreter start; each child is killed at a random moment after its
first batch; after every kill, every file under a final name must read back as a training
state; at the end, a relaunch on the directory must end on exactly the weights of an
uninterrupted run without checkpoints.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import torch
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint
from hookloop.runfile.directory_lock import LOCK_NAME
from hookloop.runfile.format import read_payload

from builders import adam, make_loop, regression_dataset, shuffled

BATCHES = 20  # an epoch of the campaign's run


def train_until_done(directory: str | None, out: str, started: object = None, *,
                     epochs: int, async_save: bool = False) -> None:
    """A training script, run in a forkserver child; ``directory=None``: no checkpoints."""
    torch.set_num_threads(1)
    loader = shuffled(regression_dataset(8 * BATCHES, features=256, seed=1), 8, seed=2)

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
        callbacks.insert(0, Checkpoint(directory, every_n_steps=1, keep_last=2, resume=True,
                                       async_save=async_save))
    loop = make_loop(callbacks, model=model, train=loader, optimizer=adam(1e-4))
    loop.fit(epochs)
    assert loop.state.step == BATCHES * epochs
    torch.save(loop.model.state_dict(), out)


def check_directory(directory: Path) -> int:
    """Every entry under a final name loads with ``weights_only=True`` and reads back as a
    training state; returns the temporary files (a killed write's) seen."""
    temporary = 0
    for path in directory.iterdir():
        if path.name.startswith(".tmp-"):
            temporary += 1
        elif path.name != LOCK_NAME:  # the killed job's lock file (the lock died with it)
            assert torch.load(path, weights_only=True)["hookloop"]["kind"] == "resume", path
            assert read_payload(path, "cpu")["hookloop"]["kind"] == "resume", path
    return temporary


def campaign(tmp_path: Path, *, epochs: int, async_save: bool, kills: int, seconds: float,
             pause: float, join: float) -> tuple[int, int]:
    """Up to ``kills`` SIGKILLs within ``seconds``, each ``uniform(0, pause)`` seconds after
    a child's first batch; then the relaunch and the uninterrupted reference (each given
    ``join`` seconds), compared bit for bit. Returns ``(kills, kills that landed while a
    write was in flight)``."""
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo: imported by the first optimizer, seconds of each child otherwise
    context.set_forkserver_preload(["torch", "torch._dynamo", "hookloop.callbacks", __name__])
    directory = tmp_path / "checkpoints"
    options = {"epochs": epochs, "async_save": async_save}
    chooser = random.Random(0)
    done = killed_mid_write = 0
    deadline = time.monotonic() + seconds
    while done < kills and time.monotonic() < deadline:
        started = context.Event()
        child = context.Process(target=train_until_done, kwargs=options,
                                args=(str(directory), str(tmp_path / "w.pt"), started))
        child.start()
        while not started.wait(0.05) and child.is_alive():
            pass
        if not child.is_alive():
            break  # it finished before it could be killed
        time.sleep(chooser.uniform(0.0, pause))
        try:
            os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        except ProcessLookupError:  # it finished during the sleep; the forkserver reaped it
            break
        child.join(30)
        if child.exitcode == -signal.SIGKILL:
            done += 1
            killed_mid_write += check_directory(directory) > 0
    for target, out in ((str(directory), "resumed.pt"), (None, "reference.pt")):
        child = context.Process(target=train_until_done, args=(target, str(tmp_path / out)),
                                kwargs=options)
        child.start()
        child.join(join)
        assert child.exitcode == 0
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name
    assert check_directory(directory) == 0
    print(f"{done} kills, {killed_mid_write} in the middle of a write")
    return done, killed_mid_write
