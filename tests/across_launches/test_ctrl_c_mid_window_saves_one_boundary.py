"""A checkpoint written at a Ctrl-C inside an accumulation window describes one moment in
all its parts: the position of the last step boundary and the callbacks' states of that
boundary (a batch counter does not resume one batch ahead). Resumed from it, the run ends
as the uninterrupted one, by torch.equal; so does fit() again in the same process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, GradAccumulation

from builders import RaiseAtBatch, dropout_loop, same_weights


class CountedRate(Callback):
    """Counts the training batches it has seen and sets the learning rate from the count,
    so a count one batch off changes the weights."""

    def __init__(self) -> None:
        self.batches = 0

    def on_batch_start(self, loop: Loop) -> None:
        self.batches += 1
        for group in loop.optimizer.param_groups:
            group["lr"] = 0.05 / (1 + 0.1 * self.batches)

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]


EPOCHS = 2


def uninterrupted() -> tuple[Loop, CountedRate]:
    counter = CountedRate()
    loop = dropout_loop([GradAccumulation(2), counter], batches=8)
    loop.fit(EPOCHS)
    return loop, counter


@pytest.mark.parametrize("batch, event", [(5, "after_forward"), (4, "on_batch_start"),
                                          (1, "after_forward")],
                         ids=["window-end", "window-start", "first-window"])
def test_a_resume_from_the_ctrl_c_checkpoint_equals_the_uninterrupted_run(
        tmp_path: Path, batch: int, event: str) -> None:
    reference, reference_counter = uninterrupted()
    counter = CountedRate()
    with pytest.raises(KeyboardInterrupt):
        dropout_loop([GradAccumulation(2), counter, RaiseAtBatch(1, batch, KeyboardInterrupt,
                                                                 event=event),
                      Checkpoint(tmp_path)], batches=8).fit(EPOCHS)
    saved = torch.load(sorted(tmp_path.glob("*.pt"))[-1], weights_only=True)
    done = saved["loop"]["batch_idx"]
    assert done == batch - batch % 2  # the last step boundary
    assert saved["callbacks"]["CountedRate"]["batches"] == 8 + done  # of that boundary
    resumed_counter = CountedRate()
    resumed = dropout_loop([GradAccumulation(2), resumed_counter, Checkpoint(tmp_path,
                                                                             resume=True)],
                           batches=8)
    resumed.fit(EPOCHS)
    assert resumed_counter.batches == reference_counter.batches == 8 * EPOCHS
    assert same_weights(resumed, reference)


def test_fit_again_after_a_ctrl_c_mid_window_equals_the_uninterrupted_run() -> None:
    reference, _ = uninterrupted()
    counter = CountedRate()
    loop = dropout_loop([GradAccumulation(2), counter,
                         RaiseAtBatch(0, 3, KeyboardInterrupt, event="after_forward")], batches=8)
    with pytest.raises(KeyboardInterrupt):
        loop.fit(EPOCHS)
    assert counter.batches == 2  # put back to the boundary after batch 2
    loop.fit(EPOCHS)
    assert counter.batches == 8 * EPOCHS
    assert same_weights(loop, reference)
