"""A loop's DataLoader workers stop cleanly when the loop is collected
(`hookloop.engine.data.worker_queues_kept`).

A loop is freed by Python's cyclic garbage collector. Without the keeper, the collector
closed the workers' queues before the DataLoader iterator's ``__del__`` sent its stop
message through them: torch waited 5 s for each worker and then terminated it (10 s for
two). The oracle is each worker's exit code: 0 when it got the stop message and returned,
negative when it was terminated."""

from __future__ import annotations

import gc
import multiprocessing

import torch
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Loop


class _StopAtStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step == self.step:
            loop.stop()


def _exit_codes_after_the_loop_is_collected(persistent: bool, stop_at: int | None) -> list:
    dataset = TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
    loader = DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=persistent)
    model = torch.nn.Linear(3, 1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                loss_fn=torch.nn.functional.mse_loss, device="cpu", sanity_val_batches=0,
                callbacks=[] if stop_at is None else [_StopAtStep(stop_at)])
    before = set(multiprocessing.active_children())
    loop.fit(1)
    workers = [child for child in multiprocessing.active_children() if child not in before]
    assert len(workers) == 2, workers  # alive: kept for the next fit
    del loop, loader
    gc.collect()  # the loop is in reference cycles: only the collector frees it
    for worker in workers:
        worker.join(timeout=30)
    return [worker.exitcode for worker in workers]


def test_the_workers_of_an_epoch_stop_cut_short_exit_cleanly_when_the_loop_goes() -> None:
    assert _exit_codes_after_the_loop_is_collected(persistent=False, stop_at=2) == [0, 0]


def test_persistent_workers_exit_cleanly_when_the_loop_goes() -> None:
    assert _exit_codes_after_the_loop_is_collected(persistent=True, stop_at=None) == [0, 0]
