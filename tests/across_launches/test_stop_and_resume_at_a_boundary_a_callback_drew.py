"""A boundary a callback drew with ``loop.state.step_boundary`` is where the run's position
is (issue 16, item 16): a stop waits for it (it stopped inside the window since the loop
redesign), ``fit()`` again continues from it, and Metrics' training sums resume from it.

The callback steps as transformers' run_glue_no_trainer does (``step % 3 == 0`` or the last
batch); the loop alone would have a boundary after every batch. The oracle is the same run
without the stop or the failure.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from builders import DrawnBoundary, regression_batches, sgd, two_layers, weights
from hookloop import Callback, Loop
from hookloop.callbacks import Metrics

K, BATCHES = 3, 10


def glue_condition(batch_idx: int) -> bool:
    return batch_idx % K == 0 or batch_idx == BATCHES - 1


def make_loop(*callbacks: Callback) -> Loop:
    torch.manual_seed(0)
    model = two_layers(4, 8, 1, nn.Tanh(), nn.Dropout(0.1))
    loop = Loop(model, sgd(0.1, momentum=0.9)(model.parameters()),
                regression_batches(BATCHES, size=5, features=4, seed=3), loss_fn=F.mse_loss,
                device="cpu", callbacks=list(callbacks))
    torch.manual_seed(1)
    return loop


class StopAt(Callback):
    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.epoch == 0 and loop.state.batch_idx == self.batch_idx:
            loop.stop("a test stop")


@pytest.mark.parametrize("at", ["on_batch_start", "after_backward"])
def test_a_stop_waits_for_the_boundary_the_callback_drew(at: str) -> None:
    """Stopped at batch 4 (inside the callback's window 4..6), the loop trains on to batch 6
    and steps; a later fit continues from batch 7: the weights of the run without the stop."""
    uninterrupted = make_loop(DrawnBoundary(glue_condition, at=at, divide_by=K))
    uninterrupted.fit(2)
    glue = DrawnBoundary(glue_condition, at=at, divide_by=K)
    loop = make_loop(glue, StopAt(4))
    loop.fit(2)
    assert loop.position == (0, 7, 3) and glue.steps_at == [0, 3, 6]
    loop.fit(2)
    assert loop.state.step == 2 * 4 and glue.steps_at == [0, 3, 6] + [9] + [0, 3, 6, 9]
    assert all(torch.equal(value, weights(uninterrupted)[key])
               for key, value in weights(loop).items())


class FailAt(Callback):
    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_batch_start(self, loop: Loop) -> None:
        if loop.state.batch_idx == self.batch_idx:
            raise RuntimeError("a test failure")


def mean_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).abs().mean()


@pytest.mark.parametrize("at", ["on_batch_start", "after_backward"])
def test_metrics_training_sums_resume_at_a_boundary_a_callback_drew(at: str) -> None:
    """A run that failed at batch 9 resumes from the boundary after batch 6 (a fresh loop
    loading its state): Metrics' train_mae equals the uninterrupted run's."""

    def run(*extra: Callback) -> Loop:
        return make_loop(DrawnBoundary(glue_condition, at=at, divide_by=K),
                         Metrics(mae=mean_error, on_train=True), *extra)

    expected = run().fit(1).metrics["train_mae"]
    failing = run(FailAt(9))
    with pytest.raises(RuntimeError, match="a test failure"):
        failing.fit(1)
    assert failing.position == (0, 7, 3)
    saved = failing.state_dict()
    assert saved["callbacks"]["Metrics(mae)"]["batch_idx"] == 7  # the sums at that boundary
    resumed = run()
    resumed.load_state_dict(saved)
    assert resumed.fit(1).metrics["train_mae"] == expected
