"""torchrun script: DDP training parity, no_sync under accumulation, rank-0-only dispatch.

Usage: torchrun --nproc_per_node=2 train.py OUT_DIR [--accumulate-with-callback]
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader

from common import (classification_data, make_model, make_optimizer, rank, regression_data,
                    save, shuffled_loader)
from hookloop import Callback, Loop, distributed
from hookloop.callbacks import LRScheduler, Metrics
from hookloop.callbacks.ddp import DDP

try:
    from hookloop.callbacks import GradAccumulation
except ImportError:  # built by another helper; until then set the window by hand
    GradAccumulation = None


class RankZeroRecorder(Callback):
    rank_zero_only = True

    def __init__(self) -> None:
        self.events: list[str] = []

    def on_fit_start(self, loop: Loop) -> None:
        self.events.append("on_fit_start")

    def after_step(self, loop: Loop) -> None:
        self.events.append("after_step")


class Window(Callback):
    """Accumulation window without loss scaling (stands in for GradAccumulation)."""

    def setup(self, loop: Loop) -> None:
        loop.accumulation_steps = 2


class CountAllReduces(Callback):
    """Counts gradient all-reduce rounds with a DDP communication hook."""

    def __init__(self) -> None:
        self.rounds = 0
        self.syncing_backwards = 0

    def on_fit_start(self, loop: Loop) -> None:
        assert isinstance(loop.model, nn.parallel.DistributedDataParallel), type(loop.model)

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            if bucket.is_last():
                self.rounds += 1
            return default_hooks.allreduce_hook(None, bucket)

        loop.model.register_comm_hook(None, hook)


class Helpers(Callback):
    """Exercises hookloop.distributed's helpers while the group exists."""

    def __init__(self) -> None:
        self.results: dict[str, object] = {}

    def on_fit_start(self, loop: Loop) -> None:
        me = distributed.rank()
        self.results["sums"] = distributed.all_reduce_sums({"x": me + 1.0, "n": torch.tensor(1)})
        self.results["gathered"] = distributed.all_gather_object({"rank": me})
        self.results["any"] = [distributed.any_true(me == 1), distributed.any_true(False)]
        try:
            distributed.all_reduce_sums({f"key{me}": 1.0})
        except ValueError as error:
            self.results["mismatch"] = str(error)


class Losses(Callback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []
        self.train_batches = self.val_batches = -1

    def on_fit_start(self, loop: Loop) -> None:
        self.train_batches = len(loop.train_data)
        self.val_batches = -1 if loop.val_data is None else len(loop.val_data)

    def on_epoch_end(self, loop: Loop) -> None:
        self.metrics.append(dict(loop.state.metrics))


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=-1) == targets).float().mean()


def target_probability(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return outputs.softmax(-1).gather(1, targets[:, None]).mean()


class SyncedSampleCount:
    """torchmetrics-style object that synchronises inside compute(), as torchmetrics does:
    a rank that skipped compute() would leave the others waiting in the all-reduce."""

    def reset(self) -> None:
        self.count = torch.zeros(())

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.count = self.count + len(targets)

    dist_sync_on_step = False  # torchmetrics' flag: this object synchronises itself

    def compute(self) -> torch.Tensor:
        total = self.count.clone()
        if dist.is_available() and dist.is_initialized():  # as torchmetrics: only in a group
            dist.all_reduce(total)
        return total


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def parity() -> None:
    model = make_model(seed=1)
    train = shuffled_loader(regression_data(24, seed=2), batch_size=3, seed=7)
    val = DataLoader(regression_data(11, seed=3), batch_size=2)
    recorder, losses = RankZeroRecorder(), Losses()
    loop = Loop(model, make_optimizer(model), train, val_data=val,
                loss_fn=nn.functional.mse_loss, callbacks=[DDP(), recorder, losses],
                device="cpu")
    state = loop.fit(2)
    assert loop.model is model and loop.train_data is train and loop.val_data is val
    assert not dist.is_initialized(), "the group DDP created must be destroyed at fit end"
    save("parity", weights(model))
    save("parity_log", {"metrics": losses.metrics, "step": state.step,
                        "recorded": recorder.events})


def accumulation() -> None:
    model = make_model(seed=4)
    train = DataLoader(regression_data(30, seed=5), batch_size=3)
    counter, losses = CountAllReduces(), Losses()
    totals: list[int] = []

    def constant_schedule(optimizer: torch.optim.Optimizer, total_steps: int) -> object:
        totals.append(total_steps)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    window = GradAccumulation(2) if GradAccumulation is not None and \
        "--accumulate-with-callback" not in sys.argv else Window()
    loop = Loop(model, make_optimizer(model), train, loss_fn=nn.functional.mse_loss,
                callbacks=[DDP(), window, counter, losses, LRScheduler(constant_schedule)],
                device="cpu")
    state = loop.fit(2)
    save("accumulation", weights(model))
    save("accumulation_log", {"rounds": counter.rounds, "step": state.step,
                              "batches": losses.train_batches,
                              "scheduler_total_steps": totals,
                              "window": type(window).__name__})


def uneven_validation_with_buffers() -> None:
    # One validation sample for two ranks: rank 1 runs no validation batch at all. A model
    # with buffers makes DDP's forward broadcast them, which would hang here. Metrics must
    # still join the reduction (and the object's synchronising compute()) on rank 1.
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    train = DataLoader(classification_data(8, seed=7), batch_size=2)
    val = DataLoader(classification_data(1, seed=8), batch_size=4)
    losses, helpers = Losses(), Helpers()
    metrics = Metrics(acc=accuracy, prob=target_probability, count=SyncedSampleCount())
    loop = Loop(model, make_optimizer(model), train, val_data=val,
                loss_fn=nn.functional.cross_entropy, callbacks=[DDP(), metrics, losses, helpers],
                device="cpu")
    loop.fit(1)
    save("buffers", weights(model))
    # validate() after fit, whose end destroyed the group: each rank validates all the data
    # with the same model (fit's end shared rank 0's BatchNorm statistics).
    again = loop.validate()
    save("buffers_log", {"metrics": losses.metrics, "val_batches": losses.val_batches,
                         "validate": again, "helpers": helpers.results})


if __name__ == "__main__":
    parity()
    accumulation()
    uneven_validation_with_buffers()
    print(f"rank {rank()} done", flush=True)
