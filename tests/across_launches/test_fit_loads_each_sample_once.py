"""A fit loads each sample it trains on once, and nothing else: no sample read ahead to
check the data (the first batch is checked when it arrives), so a resume loads none it
trained on. Loads are counted in the dataset's __getitem__, in the DataLoader's workers
too (each load appends its index to a file)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint

from builders import StopAt

SAMPLES, BATCH, EPOCHS = 12, 4, 2  # 3 batches an epoch


class Logged(Dataset):
    """Sample i is ([i], [0]); every load appends i to ``log`` (from any process)."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        with open(self.log, "a") as file:
            file.write(f"{index}\n")
        return torch.tensor([float(index)]), torch.tensor([0.0])


def _loads(log: Path) -> list[int]:
    return sorted(int(line) for line in log.read_text().split()) if log.exists() else []


def _run(log: Path, workers: int, callbacks: list[Callback]) -> list[list[int]]:
    """A 2-epoch fit; returns the samples of each batch it trained on."""
    trained: list[list[int]] = []

    class Trained(Callback):
        def on_batch_end(self, loop: Loop) -> None:
            trained.append([int(value) for value in loop.state.batch[0][:, 0]])

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    loader = DataLoader(Logged(log), BATCH, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(3))
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                loss_fn=torch.nn.functional.mse_loss, device="cpu",
                callbacks=[*callbacks, Trained()], sanity_val_batches=0)
    try:
        loop.fit(EPOCHS)
    except SystemExit:  # the resumable stop that ends the interrupted launch
        pass
    return trained


@pytest.mark.parametrize("workers", [0, 2])
def test_a_fit_loads_each_sample_once_and_a_resume_none_it_trained_on(
        tmp_path: Path, workers: int) -> None:
    fresh = tmp_path / "fresh.log"
    uninterrupted = _run(fresh, workers, [])
    assert _loads(fresh) == sorted(list(range(SAMPLES)) * EPOCHS)  # 24 loads, not 25
    stopped = _run(tmp_path / "stopped.log", workers,
                   [Checkpoint(tmp_path / "ckpt", every_n_steps=1), StopAt(4, resumable=True)])
    assert stopped == uninterrupted[:4]  # epoch 0 and the first batch of epoch 1
    resumed_log = tmp_path / "resumed.log"
    resumed = _run(resumed_log, workers, [Checkpoint(tmp_path / "ckpt", resume=True)])
    assert resumed == uninterrupted[4:]
    # exactly the samples of the 2 batches left, none of the batch of epoch 1 it trained on
    assert _loads(resumed_log) == sorted(sum(uninterrupted[4:], []))
