"""torchrun script: Metrics, EarlyStopping and Checkpoint under DDP.

Usage: torchrun --nproc_per_node=2 integration.py OUT_DIR first|resume
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from common import (classification_data, make_model, make_optimizer, out_dir, rank,
                    regression_data, save, shuffled_loader)
from hookloop import Callback, Loop
from hookloop.callbacks import DDP, Checkpoint, EarlyStopping, Metrics


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=-1) == targets).float().mean()


class Record(Callback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []
        self.start_step = -1

    def on_fit_start(self, loop: Loop) -> None:
        self.start_step = loop.state.step

    def on_epoch_end(self, loop: Loop) -> None:
        self.metrics.append(dict(loop.state.metrics))


class BatchLosses(Callback):
    """Each training batch this rank ran: epoch, index, loss and size (the oracle's data)."""

    def __init__(self) -> None:
        self.batches: list[list[float]] = []

    def after_forward(self, loop: Loop) -> None:
        state = loop.state
        self.batches.append([state.epoch, state.batch_idx, state.loss.item(), state.batch_size])


class CrashAfterStep(Callback):
    """Raises on every rank once optimizer step ``k`` is done: Checkpoint saves on the
    exception path (rank 0 alone, no collective)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step_boundary and loop.state.step == self.k:
            raise RuntimeError(f"crash after step {self.k}")


class RankLocalValLoss(Callback):
    """Makes each rank see its own validation loss, as an unreduced metric would.

    Rank 0 improves for two epochs then worsens slowly (patience 2 runs out after epoch
    4, 0-based); rank 1 only worsens (alone, it would stop after epoch 2).
    """

    def on_validation_end(self, loop: Loop) -> None:
        epoch = loop.state.epoch
        values = [1.0, 0.9, 0.8, 0.85, 0.86, 0.87] if rank() == 0 else [1.0, 2.0, 3.0, 4.0]
        loop.state.metrics["val_loss"] = values[min(epoch, len(values) - 1)]


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def metrics_run() -> None:
    model = make_model(seed=21, outputs=3)
    train = shuffled_loader(classification_data(24, seed=22), batch_size=3, seed=23)
    val = DataLoader(classification_data(11, seed=24), batch_size=2)
    record = Record()
    loop = Loop(model, make_optimizer(model), train, val_data=val,
                loss_fn=nn.functional.cross_entropy,
                callbacks=[DDP(), Metrics(on_train=True, acc=accuracy), record], device="cpu")
    loop.fit(2)
    save("metrics", weights(model))
    save("metrics_log", {"metrics": record.metrics})


def early_stopping_run() -> None:
    model = make_model(seed=31)
    train = DataLoader(regression_data(8, seed=32), batch_size=2)
    val = DataLoader(regression_data(5, seed=33), batch_size=2)
    record = Record()
    loop = Loop(model, make_optimizer(model), train, val_data=val,
                loss_fn=nn.functional.mse_loss,
                callbacks=[DDP(), RankLocalValLoss(), EarlyStopping(patience=2), record],
                device="cpu")
    state = loop.fit(20)
    save("early_stopping_log", {"epochs_run": len(record.metrics), "last_epoch": state.epoch,
                                "reason": loop.stop_reason})


def checkpointed_loop(directory: str, resume: bool, *extra: Callback
                      ) -> tuple[Loop, nn.Module, Record, BatchLosses]:
    torch.manual_seed(41)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))
    train = shuffled_loader(regression_data(24, seed=42), batch_size=3, seed=43)
    record, losses = Record(), BatchLosses()
    callbacks = [DDP(), Checkpoint(out_dir() / directory, resume=resume), record, losses,
                 *extra]
    loop = Loop(model, make_optimizer(model), train, loss_fn=nn.functional.mse_loss,
                callbacks=callbacks, device="cpu")
    return loop, model, record, losses


if __name__ == "__main__":
    if sys.argv[2] == "first":
        metrics_run()
        early_stopping_run()
        loop, model, record, losses = checkpointed_loop("uninterrupted", resume=False)
        loop.fit(3)
        save("uninterrupted", weights(model))
        save("uninterrupted_log", {"metrics": record.metrics, "losses": losses.batches})
        loop, model, _, losses = checkpointed_loop("interrupted", resume=False)
        loop.fit(3, max_steps=6)  # stops mid-epoch 1 (4 steps per epoch and rank)
        save("interrupted", weights(model))
        save("interrupted_log", {"losses": losses.batches})
        # Last in this launch: after an exception DDP leaves the process group as it is.
        loop, model, _, losses = checkpointed_loop("crashed", False, CrashAfterStep(6))
        try:
            loop.fit(3)
        except RuntimeError as error:
            assert "crash after step 6" in str(error), error
        dist.destroy_process_group()
    else:
        loop, model, record, losses = checkpointed_loop("interrupted", resume=True)
        loop.fit(3)
        save("resumed", weights(model))
        save("resumed_log", {"start_step": record.start_step, "step": loop.state.step})
        save("resumed_epochs", {"metrics": record.metrics, "losses": losses.batches})
        loop, model, record, losses = checkpointed_loop("crashed", resume=True)
        loop.fit(3)
        save("crash_resumed", {"start_step": record.start_step, "metrics": record.metrics,
                               "losses": losses.batches})
    print(f"rank {rank()} done", flush=True)
