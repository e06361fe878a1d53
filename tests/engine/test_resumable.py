"""hookloop.engine.resumable: which data resumes how, the skipping index sampler, and the
position in samples of the epoch's global order."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from hookloop.engine.resumable import SkipBatches, data_source, global_batch, sampler_batches

from builders import make_loop


class Stateful(IterableDataset):
    """8 batches of one sample; ``done`` says how many of this pass were yielded (a pass
    that had ended starts a new one); every read is counted in ``reads``."""

    def __init__(self) -> None:
        self.done, self.reads = 0, 0

    def __iter__(self):
        for index in range(self.done if self.done < 8 else 0, 8):
            self.done, self.reads = index + 1, self.reads + 1
            noise = torch.randn(1)  # the data draws too
            yield torch.tensor([[float(index)]]) + noise, torch.tensor([[1.0]])

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done = state["done"]


def _dataset(samples: int = 24) -> TensorDataset:
    return TensorDataset(torch.arange(samples, dtype=torch.float32).reshape(-1, 1),
                         torch.zeros(samples, 1))


def test_each_kind_of_data_is_sorted() -> None:
    assert data_source(DataLoader(_dataset(), 4, shuffle=True)) == "sampler"
    assert data_source(DataLoader(Stateful(), 2)) == "stateful"  # num_workers=0: its dataset
    assert data_source(DataLoader(Stateful(), 2, num_workers=2)) == "replay"
    assert data_source(Stateful()) == "stateful"
    assert data_source([(torch.ones(1), torch.ones(1))]) == "replay"


def test_skipping_draws_the_same_stream_past_its_first_items() -> None:
    def sampler():
        return BatchSampler(RandomSampler(range(20), generator=torch.Generator().manual_seed(3)),
                            4, False)
    skipping = SkipBatches(sampler(), 2)
    assert list(skipping) == list(sampler())[2:]
    assert len(list(skipping)) == 5  # later passes are the sampler's own, whole


def test_the_resumed_loader_reads_only_the_batches_after_the_position() -> None:
    reads = []

    class Counted(TensorDataset):
        def __getitem__(self, index):
            reads.append(index)
            return super().__getitem__(index)

    data = Counted(*_dataset().tensors)
    loader = DataLoader(data, 4, shuffle=True, generator=torch.Generator().manual_seed(1))
    expected = [batch for batch in DataLoader(_dataset(), 4, shuffle=True,
                                              generator=torch.Generator().manual_seed(1))]
    reads.clear()
    resumed = list(sampler_batches(loader, 4, None))
    assert len(reads) == 8 and len(resumed) == 2
    assert all(torch.equal(a[0], b[0]) for a, b in zip(resumed, expected[4:]))
    assert len(list(loader)) == 6  # the loader itself is left as it was


def test_the_position_is_saved_in_samples_of_the_global_order() -> None:
    dataset = _dataset()
    assert global_batch(DataLoader(dataset, 4)) == 4
    sharded = DataLoader(dataset, 3, sampler=DistributedSampler(dataset, num_replicas=2, rank=0))
    assert global_batch(sharded) == 6  # a batch on each of 2 ranks
    assert global_batch([(torch.ones(1), torch.ones(1))]) is None

    loop = make_loop(model=lambda: torch.nn.Linear(1, 1), train=sharded,
                     sanity_val_batches=0)
    loop.fit(1, max_steps=3)
    state = loop.state_dict()["loop"]
    assert state["batch_idx"] == 3 and state["epoch_samples"] == 3 * 6


def test_a_stateful_iterable_resumes_from_its_state_without_replay(tmp_path) -> None:
    from hookloop.callbacks import Checkpoint

    from builders import StopAt, same_weights

    def run(callbacks, data):
        return make_loop(callbacks, model=lambda: torch.nn.Linear(1, 1), train=data,
                         sanity_val_batches=0)

    expected = run([], Stateful())
    expected.fit(2)
    first = run([Checkpoint(tmp_path, every_n_steps=1), StopAt(11, resumable=True)], Stateful())
    try:
        first.fit(2)
    except SystemExit:  # the launch ended at step 11: 3 of the second epoch's 8 batches
        pass
    data = Stateful()
    resumed = run([Checkpoint(tmp_path, resume=True)], data)
    resumed.fit(2)
    assert resumed.state.step == 16
    assert same_weights(resumed, expected)
    assert data.reads == 5  # the second epoch's last 5: none of the 3 trained on again


def test_a_per_rank_data_state_on_another_number_of_ranks_is_refused(tmp_path) -> None:
    import pytest

    from hookloop import CheckpointError
    from hookloop.callbacks import Checkpoint

    from builders import StopAt

    def run(callbacks):
        return make_loop(callbacks, model=lambda: torch.nn.Linear(1, 1), train=Stateful(),
                         sanity_val_batches=0)

    first = run([Checkpoint(tmp_path, every_n_steps=1), StopAt(3, resumable=True)])
    with pytest.raises(SystemExit):
        first.fit(1)
    (path,) = [p for p in tmp_path.glob("*.pt") if "step=00000003" in p.name]
    state = torch.load(path, weights_only=True)
    state["loop"]["world_size"] = 2  # as if two ranks had written it
    resumed = run([])
    resumed.load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"2 process\(es\).*this run has 1.*Relaunch on 2"):
        resumed.fit(1)


def test_workers_whose_draws_cannot_resume_are_named_at_the_resume(tmp_path) -> None:
    """persistent_workers=True: the order and the samples resume exactly, the workers'
    random draws start from fresh seeds, and a warning says so (never silent)."""
    import pytest

    from hookloop.callbacks import Checkpoint

    from builders import StopAt

    def run(callbacks):
        loader = DataLoader(_dataset(), 4, shuffle=True, num_workers=2, persistent_workers=True,
                            generator=torch.Generator().manual_seed(1))
        return make_loop(callbacks, model=lambda: torch.nn.Linear(1, 1), train=loader,
                         sanity_val_batches=0)

    with pytest.raises(SystemExit):
        run([Checkpoint(tmp_path, every_n_steps=1), StopAt(2, resumable=True)]).fit(1)
    resumed = run([Checkpoint(tmp_path, resume=True)])
    with pytest.warns(RuntimeWarning, match="persistent_workers=True.*fresh seeds"):
        resumed.fit(1)
    assert resumed.state.step == 6


def _order_of_epochs(workers: int, callbacks: list) -> dict[int, list[int]]:
    """The samples each epoch of a 3-epoch fit trained on, in order (6 batches of 4, shuffled
    by the loader's generator; sample i's input is i), over ``workers`` DataLoader workers."""
    from hookloop import Callback

    seen: dict[int, list[int]] = {}

    class Seen(Callback):
        def on_batch_end(self, loop):
            seen.setdefault(loop.state.epoch, []).extend(
                int(value) for value in loop.state.batch[0][:, 0])

    loader = DataLoader(_dataset(), 4, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(1))
    loop = make_loop([*callbacks, Seen()], model=lambda: torch.nn.Linear(1, 1), train=loader,
                     sanity_val_batches=0)
    try:
        loop.fit(3)
    except SystemExit:  # the stop that ends the interrupted launch
        pass
    return seen


@pytest.mark.parametrize("saved, resumed", [(0, 2), (2, 0), (2, 1)])
def test_a_resume_with_another_num_workers_draws_the_uninterrupted_run_s_later_epochs(
        tmp_path, saved: int, resumed: int) -> None:
    """The shuffling sampler draws its next permutation from the loader's generator when its
    iterator runs out: with workers, whose prefetch runs ahead, before the position of
    step 3 (batch 3 of 6), without workers after it. Resumed with another number of
    workers, every later epoch must still be the uninterrupted run's order (which is the
    same for any number of workers, as torch draws it)."""
    import warnings

    from hookloop.callbacks import Checkpoint

    from builders import StopAt

    expected = _order_of_epochs(saved, [])
    assert _order_of_epochs(resumed, []) == expected  # torch: the same for 0 and 2 workers
    stopped = _order_of_epochs(saved, [Checkpoint(tmp_path, every_n_steps=1),
                                       StopAt(3, resumable=True)])
    assert stopped == {0: expected[0][:12]}
    with warnings.catch_warnings():  # the workers' own draws start afresh: said, not tested
        warnings.simplefilter("ignore", RuntimeWarning)
        order = _order_of_epochs(resumed, [Checkpoint(tmp_path, resume=True)])
    assert order == {0: expected[0][12:], 1: expected[1], 2: expected[2]}


class _CountingStream:
    """An iterable with a state (no len()): batch i holds the value i."""

    def __init__(self) -> None:
        self.i = 0

    def __iter__(self):
        while self.i < 20:
            self.i += 1
            yield torch.full((2, 1), float(self.i)), torch.full((2, 1), 0.5)

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]


def test_a_stateful_iterable_under_accumulation_resumes_at_its_boundary() -> None:
    """With accumulation the loop fetches one batch ahead (to know where a window ends):
    the state saved at a boundary is the one from before that fetch, so the resumed fit
    trains batch 5 too (it skipped it silently before) and ends on the same weights."""
    from hookloop import Callback, Loop, Suspended
    from hookloop.callbacks import GradAccumulation

    class StopAt(Callback):
        def after_step(self, loop) -> None:
            if loop.state.step == 2:
                loop.stop("test", resumable=True)

    class Seen(Callback):
        def __init__(self) -> None:
            self.values: list[int] = []

        def on_batch_start(self, loop) -> None:
            self.values.append(int(loop.state.batch[0][0, 0]))

    def build(*callbacks: Callback) -> Loop:
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        return Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), _CountingStream(),
                    loss_fn=torch.nn.functional.mse_loss, device="cpu",
                    callbacks=[GradAccumulation(2), *callbacks])

    uninterrupted = build()
    uninterrupted.fit(1)
    first = build(StopAt())
    with pytest.raises(Suspended):  # a resumable stop ends the launch, the run goes on
        first.fit(1)
    assert tuple(first.position) == (0, 4, 2)
    seen = Seen()
    resumed = build(seen)
    resumed.load_state_dict(first.state_dict())
    resumed.fit(1)
    assert seen.values == list(range(5, 21))
    for name, value in uninterrupted.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


def _saved_by_two_ranks(tmp_path, train) -> tuple[dict, object]:
    """A checkpoint of a run stopped inside its epoch (step 3), edited as if two ranks had
    written it, and a fresh loop over ``train()`` to resume it on this one."""
    from hookloop.callbacks import Checkpoint

    from builders import StopAt

    def run(callbacks):
        return make_loop(callbacks, model=lambda: torch.nn.Linear(1, 1), train=train,
                         sanity_val_batches=0)

    with pytest.raises(SystemExit):
        run([Checkpoint(tmp_path, every_n_steps=1), StopAt(3, resumable=True)]).fit(1)
    (path,) = [p for p in tmp_path.glob("*.pt") if "step=00000003" in p.name]
    state = torch.load(path, weights_only=True)
    state["loop"]["world_size"] = 2
    return state, run([])


def test_a_stateful_loader_s_per_rank_state_on_another_number_of_ranks_is_refused(
        tmp_path) -> None:
    """torchdata's StatefulDataLoader on each rank holds that rank's own place in its shard:
    it cannot be split over other ranks, so the resume names it and the fix."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from hookloop import CheckpointError

    state, resumed = _saved_by_two_ranks(tmp_path, lambda: StatefulDataLoader(
        _dataset(), 4, shuffle=True, generator=torch.Generator().manual_seed(1)))
    assert state["ranks"][0]["data_state"] is not None
    resumed.load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"StatefulDataLoader\.state_dict\(\).*cannot be "
                                              r"split or merged.*Relaunch on 2 process"):
        resumed.fit(1)
    assert resumed.state.step == 0  # refused before any training


def test_another_number_of_ranks_inside_an_epoch_of_an_order_that_cannot_be_resharded_is_refused(
        tmp_path) -> None:
    """A RandomSampler's order is not a DistributedSampler's: the trained samples cannot be
    told apart on the new ranks, so the resume refuses rather than approximate."""
    from hookloop import CheckpointError

    state, resumed = _saved_by_two_ranks(tmp_path, lambda: DataLoader(
        _dataset(), 4, shuffle=True, generator=torch.Generator().manual_seed(1)))
    resumed.load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"inside epoch 1 by 2 process\(es\) and this run "
                                              r"has 1.*DataLoader\) does not draw from a torch "
                                              r"DistributedSampler.*Relaunch on 2"):
        resumed.fit(1)


def test_the_rest_of_an_epoch_is_its_order_s_samples_from_the_position_sharded() -> None:
    """Over any number of ranks, the shares of the rest are the order's samples from the
    position on, each once when they divide evenly, and every rank gets as many."""
    from hookloop.engine.resumable import RestOfEpoch

    def sampler(replicas: int, rank: int) -> DistributedSampler:
        made = DistributedSampler(range(36), num_replicas=replicas, rank=rank, shuffle=True,
                                  seed=7)
        made.set_epoch(3)
        return made

    order = list(sampler(1, 0))
    for replicas, start in ((1, 10), (2, 10), (3, 12), (3, 13), (4, 36)):
        shares = [list(RestOfEpoch(sampler(replicas, rank), start)) for rank in range(replicas)]
        assert len({len(share) for share in shares}) == 1
        assert set().union(*shares) == set(order[start:])
        if (36 - start) % replicas == 0:
            assert sorted(sum(shares, [])) == sorted(order[start:])
    # From a position that is whole batches of the new ranks, the same as DistributedSampler's.
    assert list(RestOfEpoch(sampler(3, 1), 12)) == list(sampler(3, 1))[4:]


def _resumed_at_another_global_batch(tmp_path, samples: int, stack, schedule, stop_step: int,
                                     edit: dict) -> tuple:
    """A run over a DistributedSampler's order (one rank, seed 3, batches of 4) stopped at
    ``stop_step``; its checkpoint's loop part edited by ``edit`` as if a run of another
    global batch (another number of ranks) had written it; a fresh loop resuming it for the
    2 epochs. ``stack()`` and ``schedule()`` make the callbacks each run starts with.
    Returns ``(reads, total_steps, resumed, saved)``: the ``(epoch, index)`` the dataset
    read inside the resumed epochs, ``loop.total_steps`` at its fit start, the
    resumed loop, and the loop part as saved (before the edit)."""
    from hookloop import Callback
    from hookloop.callbacks import Checkpoint

    from builders import StopAt

    reads: list[tuple[int, int]] = []

    class Counted(TensorDataset):
        epoch: int | None = None

        def __getitem__(self, index):
            if self.epoch is not None:  # inside an epoch (not the loop's checks)
                reads.append((self.epoch, int(index)))
            return super().__getitem__(index)

    dataset = Counted(*_dataset(samples).tensors)

    class Epochs(Callback):
        def on_epoch_start(self, loop) -> None:
            dataset.epoch = loop.state.epoch

        def on_fit_start(self, loop) -> None:
            self.total = loop.total_steps

    def run(callbacks):
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
        return make_loop([*stack(), schedule(), *callbacks], model=lambda: torch.nn.Linear(1, 1),
                         train=DataLoader(dataset, 4, sampler=sampler), sanity_val_batches=0)

    with pytest.raises(SystemExit):
        run([Checkpoint(tmp_path, every_n_steps=1), StopAt(stop_step, resumable=True)]).fit(2)
    (path,) = [p for p in tmp_path.glob("*.pt") if f"step={stop_step:08d}" in p.name]
    state = torch.load(path, weights_only=True)
    saved = dict(state["loop"])
    state["loop"].update(edit)
    dataset.epoch = None
    reads.clear()
    epochs = Epochs()
    resumed = run([epochs])
    resumed.load_state_dict(state)
    resumed.fit(2)
    return reads, epochs.total, resumed, saved


def test_a_position_at_another_global_batch_goes_on_with_the_rest_of_the_epoch_s_order(
        tmp_path) -> None:
    """A checkpoint edited as if a run of global batch 5 (another number of ranks) had
    trained 10 samples of the epoch: a loader of batch 4 over the same DistributedSampler
    order reads exactly the order's samples from the 11th on, in order (none before), then
    whole epochs; `loop.total_steps` counts the steps taken, so a factory's schedule ends
    at the run's last step (at its min_lr)."""
    import functools

    from hookloop.callbacks import LRScheduler
    from hookloop.schedules import warmup_cosine

    reads, total, resumed, saved = _resumed_at_another_global_batch(
        tmp_path, 24, lambda: [], lambda: LRScheduler(
            functools.partial(warmup_cosine, warmup_steps=1, min_lr=0.01)),
        3, dict(batch_idx=2, epoch_samples=10, global_batch=5))
    assert (saved["epoch_samples"], saved["global_batch"]) == (12, 4)
    order = list(DistributedSampler(range(24), num_replicas=1, rank=0, shuffle=True, seed=3))
    assert [index for epoch, index in reads if epoch == 0] == order[10:]
    assert sorted(index for epoch, index in reads if epoch == 1) == list(range(24))
    # 3 steps taken, 4 batches of the 14 left, then an epoch of 6.
    assert resumed.state.step == total == 3 + 4 + 6
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.01, abs=1e-12)


def test_a_position_at_another_global_batch_with_accumulation_counts_the_steps_it_takes(
        tmp_path) -> None:
    """Found in review: with GradAccumulation(2), a position that is a whole number of the
    new batches (4 samples: one batch of 4) but not of windows made `total_steps` count the
    windows from the resume batch while the epoch counted them from batch 0, so the run took
    one step more than its schedule was built for (OneCycleLR raised at step 7 of 6). Hand
    count: step 1 saved, then batches 1..4 of 5 step at 1, 3 and the last, partial window
    (3), then an epoch of 3: 7."""
    from hookloop.callbacks import GradAccumulation, LRScheduler

    reads, total, resumed, saved = _resumed_at_another_global_batch(
        tmp_path, 20, lambda: [GradAccumulation(2)], lambda: LRScheduler(
            lambda optimizer, total: torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=0.1, total_steps=total)),
        1, dict(epoch_samples=4, global_batch=2))  # as if 2 batches of 2 samples
    assert (saved["batch_idx"], saved["epoch_samples"]) == (2, 8)
    order = list(DistributedSampler(range(20), num_replicas=1, rank=0, shuffle=True, seed=3))
    # The rest of the epoch, none of its first 4 samples.
    assert [index for epoch, index in reads if epoch == 0] == order[4:]
    assert resumed.state.step == total == 1 + 3 + 3
