"""SIGKILL at random moments while a run saves to ``s3://`` (moto's server on localhost),
then a relaunch to the end, compared with an uninterrupted run (`test_remote_kill`).

Children are forked from a forkserver that imported torch once (as `kill_campaign`). After
each kill: every save the store lists has all its objects, each of the size and SHA-256
its manifest holds (downloaded and checked); the store lists at most ``KEEP + 1`` rotating
saves and ``TOP_K + 1`` ranked ones (``best-val_loss=...``; the one over is a new best
whose predecessor's deletion the kill cut); and the objects without a manifest (a killed
upload) are counted. After the relaunch the ranked saves are the ``TOP_K`` steps with the
lowest validation loss of the uninterrupted run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import tempfile
import time

import torch
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint
from hookloop.runfile.remote_store import RemoteStore

from builders import adam, make_loop, regression_dataset, shuffled

BATCHES, KEEP, TOP_K = 50, 2, 2


def train_until_done(url: str | None, out: str, options: dict, staging: str,
                     started: object = None, epochs: int = 10, async_save: bool = False) -> None:
    """A training script, run in a forkserver child; ``url=None``: no checkpoints."""
    torch.set_num_threads(1)
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    loader = shuffled(regression_dataset(8 * BATCHES, features=128, seed=1), 8, seed=2)

    def model() -> nn.Module:  # ~0.3M parameters: ~4 MB saves with Adam's moments
        return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 1))

    class Started(Callback):
        def on_batch_end(self, loop: Loop) -> None:
            if started is not None:
                started.set()  # type: ignore[attr-defined]

    class Record(Callback):  # each validation's (step, val_loss): the top-k oracle
        def __init__(self) -> None:
            self.seen: list[tuple[int, float]] = []

        def on_validation_end(self, loop: Loop) -> None:
            self.seen.append((loop.state.step, float(loop.state.metrics["val_loss"])))

    record = Record()
    callbacks: list[Callback] = [Started(), record]
    if url is not None:
        callbacks.insert(0, Checkpoint(url, every_n_steps=1, keep_last=KEEP, resume=True,
                                       monitor="val_loss", save_top_k=TOP_K,
                                       storage_options=options, staging_dir=staging,
                                       async_save=async_save))
    val = shuffled(regression_dataset(32, features=128, seed=3), 16, seed=4)
    loop = make_loop(callbacks, model=model, train=loader, val=val, optimizer=adam(1e-4))
    loop.fit(epochs)
    with open(out + ".json", "w", encoding="utf-8") as file:
        json.dump(record.seen, file)  # the reference's; a relaunch records only its own
    assert loop.state.step == BATCHES * epochs
    torch.save(loop.model.state_dict(), out)


def check_store(store: RemoteStore) -> tuple[int, int]:
    """Every listed save complete and verified; ``(rotating saves, partial names)``; at
    most ``TOP_K + 1`` ranked saves."""
    names = store.saves()
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            store.download(name, os.path.join(folder, name))  # raises on a missing object
    assert len(ranked_steps(names)) <= TOP_K + 1, names
    return sum(name.startswith("epoch=") for name in names), len(store.partial())


def ranked_steps(names: list[str]) -> list[int]:
    """The steps of the ranked saves (``best-val_loss=0.25-step=00000030.pt``)."""
    return sorted(int(name.rsplit("step=", 1)[1].split(".")[0]) for name in names
                  if name.startswith("best-"))


def campaign(url: str, options: dict, staging: str, out: str, *, kills: int, seconds: float,
             pause: float, async_save: bool = False) -> dict[str, int]:
    """Up to ``kills`` SIGKILLs within ``seconds``; the relaunch and the reference after."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch._dynamo", "hookloop.callbacks", "s3fs",
                                    __name__])
    store = RemoteStore(url, options)
    chooser = random.Random(0)
    counts = {"kills": 0, "mid_upload": 0, "most_rotating": 0}
    deadline = time.monotonic() + seconds
    while counts["kills"] < kills and time.monotonic() < deadline:
        started = context.Event()
        child = context.Process(target=train_until_done,
                                args=(url, f"{out}/w.pt", options, staging, started),
                                kwargs={"async_save": async_save})
        child.start()
        while not started.wait(0.05) and child.is_alive():
            pass
        if not child.is_alive():
            child.join()
            assert child.exitcode == 0, f"a launch failed (exit {child.exitcode})"
            break  # it finished before it could be killed
        time.sleep(chooser.uniform(0.0, pause))
        try:
            os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        except ProcessLookupError:
            break
        child.join(30)
        if child.exitcode == -signal.SIGKILL:
            counts["kills"] += 1
            rotating, partial = check_store(store)
            assert rotating <= KEEP + 1, (rotating, store.saves())
            counts["most_rotating"] = max(counts["most_rotating"], rotating)
            counts["mid_upload"] += partial > 0
    for target, name in ((url, "resumed.pt"), (None, "reference.pt")):
        child = context.Process(target=train_until_done,
                                args=(target, f"{out}/{name}", options, staging),
                                kwargs={"async_save": async_save})
        child.start()
        child.join(300)
        assert child.exitcode == 0, name
    resumed = torch.load(f"{out}/resumed.pt", weights_only=True)
    for key, value in torch.load(f"{out}/reference.pt", weights_only=True).items():
        assert torch.equal(resumed[key], value), key
    rotating, partial = check_store(store)
    assert partial == 0 and rotating <= KEEP
    with open(f"{out}/reference.pt.json", encoding="utf-8") as file:
        seen = json.load(file)
    best = sorted(step for step, _ in sorted(seen, key=lambda item: item[1])[:TOP_K])
    assert ranked_steps(store.saves()) == best, (store.saves(), seen)
    # At the end the store holds exactly the saves of the staging directory.
    assert store.saves() == sorted(name for name in os.listdir(staging) if name.endswith(".pt"))
    return counts
