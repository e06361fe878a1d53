"""A DataLoader over a map-style dataset resumes inside an epoch without reading a sample
it trained on: the sampler's index stream is advanced to the position. Each run is killed
at random moments (a child process ends with os._exit, as a SIGKILL would: no exception
path, no last checkpoint), relaunched, killed again, relaunched to the end; the weights
are the uninterrupted run's (torch.equal), with samples that draw from torch's, Python's
and NumPy's generators in __getitem__, in the main process and in two workers; and the
last launch reads only the samples left to train on."""
from __future__ import annotations

import multiprocessing
import os
import random
import zlib
from collections.abc import Callable

import numpy
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, GradAccumulation
from hookloop.engine.samplers import UnpaddedDistributedSampler

from builders import net_loop, same_weights

SAMPLES, BATCH, EPOCHS = 40, 4, 2  # 10 batches an epoch
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "hookloop.callbacks", __name__])


class Augmented(Dataset):
    """40 samples of 4 features; each read adds noise from torch's, Python's and NumPy's
    generators (an augmentation) and counts itself in a counter the workers share."""

    def __init__(self, reads: object) -> None:
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 1, generator=g)
        self.reads = reads

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        with self.reads.get_lock():  # type: ignore[attr-defined]
            self.reads.value += 1  # type: ignore[attr-defined]
        noise = 0.1 * torch.randn(4) + torch.tensor([random.gauss(0.0, 0.1) for _ in range(4)]) \
            + torch.from_numpy(numpy.random.normal(0.0, 0.1, 4)).float()
        return self.x[index] + noise, self.y[index]


def _g(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


LOADERS: dict[str, Callable[[Dataset, int], DataLoader]] = {
    "shuffle_generator": lambda d, w: DataLoader(d, BATCH, shuffle=True, generator=_g(),
                                                 num_workers=w),
    "shuffle_default_generator": lambda d, w: DataLoader(d, BATCH, shuffle=True, num_workers=w),
    "sequential": lambda d, w: DataLoader(d, BATCH, sampler=SequentialSampler(d), num_workers=w),
    "batch_sampler": lambda d, w: DataLoader(
        d, batch_sampler=BatchSampler(RandomSampler(d, generator=_g(3)), BATCH, False),
        num_workers=w),
    "distributed_sampler": lambda d, w: DataLoader(
        d, BATCH, sampler=DistributedSampler(d, num_replicas=1, rank=0, seed=4), num_workers=w),
    "unpadded_sampler": lambda d, w: DataLoader(
        d, BATCH, sampler=UnpaddedDistributedSampler(d, 1, 0, shuffle=True, seed=4),
        num_workers=w),
}
STATEFUL: dict[str, Callable[[Dataset, int], DataLoader]] = {
    "stateful_loader": lambda d, w: _stateful_loader()(d, BATCH, shuffle=True, generator=_g(),
                                                       num_workers=w),
}


def _stateful_loader() -> type:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader


class ExitAt(Callback):
    """Ends the process at one event of one batch, as a SIGKILL of the job would (its
    DataLoader workers with it)."""

    def __init__(self, epoch: int, batch: int, event: str) -> None:
        self.at, self.event = (epoch, batch), event

    def _maybe(self, loop: Loop, event: str) -> None:
        if event == self.event and (loop.state.epoch, loop.state.batch_idx) == self.at:
            for worker in multiprocessing.active_children():
                worker.kill()
                worker.join()
            os._exit(9)

    def on_batch_start(self, loop: Loop) -> None:
        self._maybe(loop, "on_batch_start")

    def on_batch_end(self, loop: Loop) -> None:
        self._maybe(loop, "on_batch_end")


def _seed_host(value: int) -> None:
    random.seed(value)
    numpy.random.seed(value)


def _run(name: str, workers: int, callbacks: list[Callback], window: int, val: bool,
         host_seed: int, reads: object) -> Loop:
    _seed_host(host_seed)
    extra = [GradAccumulation(window)] if window > 1 else []
    val_reads = multiprocessing.get_context("fork").Value("l", 0)  # not counted
    options = dict(val=DataLoader(Augmented(val_reads), 8), val_every_n_steps=3) if val else {}
    build = LOADERS[name] if name in LOADERS else STATEFUL[name]
    loop = net_loop([*extra, *callbacks], train=build(Augmented(reads), workers),
                    sanity_val_batches=0, **options)
    loop.fit(EPOCHS)
    return loop


def _launch(directory: str, point: tuple[int, int, str], *run: object) -> None:
    name, workers, window, val, host_seed, reads = run
    torch.set_num_threads(1)
    _run(name, workers, [Checkpoint(directory, every_n_steps=1, keep_last=2, resume=True),
                         ExitAt(*point)], window, val, host_seed, reads)


def _killed_at(directory: str, point: tuple[int, int, str], *run: object) -> None:
    """One launch in a child process (forked from a forkserver that imported torch once,
    as tests/kill_campaign.py does), ended at ``point``."""
    child = CONTEXT.Process(target=_launch, args=(directory, point, *run))
    child.start()
    child.join(120)
    assert child.exitcode == 9  # killed at the point, not ended or failed before it


def _kill_points(seed: int, window: int) -> list[tuple[int, int, str]]:
    """Two moments, the second later: a batch's start or end, anywhere in the run after
    its first checkpoint (at the end of the first window)."""
    rng = random.Random(seed)
    first, second = sorted(rng.sample(range(window, EPOCHS * SAMPLES // BATCH - 1), 2))
    return [(at // 10, at % 10, rng.choice(["on_batch_start", "on_batch_end"]))
            for at in (first, second)]


CASES = [(name, 0, 1, False) for name in LOADERS] + [
    ("shuffle_generator", 2, 1, False), ("shuffle_default_generator", 2, 1, False),
    ("distributed_sampler", 2, 1, False),
    ("shuffle_generator", 0, 3, False), ("shuffle_generator", 2, 3, False),
    ("shuffle_default_generator", 0, 1, True), ("shuffle_generator", 2, 2, True),
    ("stateful_loader", 0, 1, False), ("stateful_loader", 2, 1, False),
    ("stateful_loader", 0, 3, True),
]


@pytest.mark.parametrize("name,workers,window,val", CASES)
def test_killed_twice_and_relaunched_ends_on_the_uninterrupted_weights(
        tmp_path, name, workers, window, val) -> None:
    if name in STATEFUL:
        pytest.importorskip("torchdata.stateful_dataloader")
    reads = CONTEXT.Value("l", 0)
    expected = _run(name, workers, [], window, val, 0, reads)
    points = _kill_points(zlib.crc32(repr((name, workers, window, val)).encode()), window)
    for index, point in enumerate(points):
        _killed_at(str(tmp_path), point, name, workers, window, val, 100 * index, reads)
    seen: list[int] = []

    class Start(Callback):
        def on_fit_start(self, loop: Loop) -> None:
            seen.append(loop.position.batches_done + loop.position.epoch * 10)
            reads.value = 0  # the reads of this launch only
    resumed = _run(name, workers, [Checkpoint(tmp_path, every_n_steps=1, resume=True), Start()],
                   window, val, 12345, reads)
    assert same_weights(resumed, expected), points
    assert resumed.state.step == expected.state.step
    # the last launch read the training samples left to train on, nothing more
    assert seen[0] > 0
    assert reads.value == EPOCHS * SAMPLES - seen[0] * BATCH


def test_the_oracle_sees_the_draws_in_the_workers() -> None:
    """Other worker draws give other weights: the comparison above can fail."""
    reads = CONTEXT.Value("l", 0)
    first = _run("shuffle_generator", 2, [], 1, False, 0, reads)

    class Shifted(Augmented):
        def __getitem__(self, index):
            torch.randn(1)
            return super().__getitem__(index)

    _seed_host(0)
    second = net_loop(train=DataLoader(Shifted(reads), BATCH, shuffle=True,
                                               generator=_g(), num_workers=2),
                      sanity_val_batches=0)
    second.fit(EPOCHS)
    assert not same_weights(first, second)
