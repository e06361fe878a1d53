"""History, CSVLogger and TensorBoard across a SIGKILL: a child process trains, kills itself
right after a step (a checkpoint was written earlier), is relaunched with Checkpoint(resume=True),
and every record equals the uninterrupted run's, each row and step exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import subprocess_env

SCRIPT = r'''
import json, os, signal, sys
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, CSVLogger, Metrics, TensorBoard

directory, kill_at = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
inputs, targets = torch.randn(30, 5, generator=generator), torch.randint(0, 3, (30,), generator=generator)
train = DataLoader(TensorDataset(inputs[:24], targets[:24]), batch_size=4, shuffle=True,
                   generator=torch.Generator().manual_seed(2))
val = DataLoader(TensorDataset(inputs[24:], targets[24:]), batch_size=4)
model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(8, 3))

class Kill(Callback):
    def on_batch_end(self, loop):
        if loop.state.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

accuracy = lambda outputs, y: (outputs.argmax(-1) == y).float().mean()
loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), train,
            val_data=val, loss_fn=F.cross_entropy, device="cpu",
            callbacks=[Metrics(acc=accuracy), TensorBoard(os.path.join(directory, "tb"), every_n_steps=1),
                       CSVLogger(os.path.join(directory, "log.csv"), every_n_steps=2),
                       Checkpoint(os.path.join(directory, "ckpt"), every_n_steps=4, resume=True),
                       Kill()])
state = loop.fit(3)
with open(os.path.join(directory, "history.json"), "w") as handle:
    json.dump(state.history, handle)
'''


def launch(directory: Path, kill_at: int) -> int:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(directory), str(kill_at)],
                            env=subprocess_env(), capture_output=True, text=True, timeout=240)
    if result.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(result.stderr[-4000:])
    return result.returncode


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted run, and runs killed after step 10 (6 steps an epoch; the checkpoint
    of step 8 is the newest) and after step 13 (checkpoint of step 12, an epoch's last step,
    written before that epoch's validation)."""
    out = {}
    reference = tmp_path_factory.mktemp("reference")
    assert launch(reference, -1) == 0
    out["reference"] = reference
    for kill_at in (10, 13):
        directory = tmp_path_factory.mktemp(f"killed{kill_at}")
        assert launch(directory, kill_at) == -signal.SIGKILL
        assert launch(directory, -1) == 0
        out[f"killed{kill_at}"] = directory
    return out


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(directory / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


@pytest.mark.parametrize("killed", ["killed10", "killed13"])
def test_tensorboard_has_each_step_once(runs, killed: str) -> None:
    assert scalars(runs[killed]) == scalars(runs["reference"])


@pytest.mark.parametrize("killed", ["killed10", "killed13"])
def test_csv_rows_are_those_of_the_uninterrupted_run(runs, killed: str) -> None:
    pd.testing.assert_frame_equal(pd.read_csv(runs[killed] / "log.csv"),
                                  pd.read_csv(runs["reference"] / "log.csv"), check_exact=True)


@pytest.mark.parametrize("killed", ["killed10", "killed13"])
def test_history_survives_kill_and_resume(runs, killed: str) -> None:
    """state.history is saved in the checkpoint and restored: the resumed run's rows are the
    uninterrupted run's, none lost or repeated."""
    resumed = json.loads((runs[killed] / "history.json").read_text())
    reference = json.loads((runs["reference"] / "history.json").read_text())
    assert resumed == reference
