"""MLflow and W&B (offline) across a SIGKILL and a suspended launch: a child process trains
with a tracker and TensorBoard (the oracle: the same tags, cadence and steps), is killed
after a step (a checkpoint was written earlier) or ends its launch with
``loop.stop(resumable=True)``, is relaunched with ``Checkpoint(resume=True)``, and the
tracker's own reader (``MlflowClient``; ``wandb leet inspect --json``, W&B's reader of its
offline ``.wandb`` files) shows one tracker run holding every step once, with TensorBoard's
values, closed as finished only once the run ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import console_script, subprocess_env

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

SCRIPT = r'''
import os, signal, sys
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, Metrics, MLflowLogger, TensorBoard, WandbLogger

directory, kind, kill_at, suspend_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
inputs, targets = torch.randn(30, 5, generator=generator), torch.randint(0, 3, (30,), generator=generator)
train = DataLoader(TensorDataset(inputs[:24], targets[:24]), batch_size=4, shuffle=True,
                   generator=torch.Generator().manual_seed(2))
val = DataLoader(TensorDataset(inputs[24:], targets[24:]), batch_size=4)
model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(8, 3))

class End(Callback):
    def after_step(self, loop):
        if loop.state.step == suspend_at:
            loop.stop("the test ends this launch", resumable=True)
    def on_batch_end(self, loop):
        if loop.state.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

if kind == "mlflow":
    tracker = MLflowLogger("hookloop-test", tracking_uri="file://" + os.path.join(directory, "mlruns"),
                           every_n_steps=2)
else:
    tracker = WandbLogger("hookloop-test", dir=directory, mode="offline", every_n_steps=2)
accuracy = lambda outputs, y: (outputs.argmax(-1) == y).float().mean()
loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), train,
            val_data=val, loss_fn=F.cross_entropy, device="cpu",
            callbacks=[Metrics(acc=accuracy), tracker,
                       TensorBoard(os.path.join(directory, "tb"), every_n_steps=2),
                       Checkpoint(os.path.join(directory, "ckpt"), every_n_steps=4, resume=True),
                       End()])
loop.fit(3)
'''


def environment() -> dict[str, str]:
    env = subprocess_env()
    env.update(MLFLOW_ALLOW_FILE_STORE="true", WANDB_SILENT="true", WANDB_MODE="offline")
    return env


def launch(directory: Path, kind: str, kill_at: int = -1, suspend_at: int = -1) -> int:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(directory), kind, str(kill_at),
                             str(suspend_at)], env=environment(), capture_output=True,
                            text=True, timeout=300)
    if result.returncode not in (0, 75, -signal.SIGKILL):
        raise AssertionError(result.stderr[-4000:])
    assert "RuntimeWarning" not in result.stderr, result.stderr[-3000:]
    return result.returncode


def tensorboard(directory: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(directory / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def float32(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """Values as TensorBoard stores them (float32), to compare with it exactly."""
    import struct
    return {tag: [(step, struct.unpack("f", struct.pack("f", value))[0]) for step, value in rows]
            for tag, rows in series.items()}


# ------------------------------------------------------------------ readers
def mlflow_runs(directory: Path) -> list[dict]:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient("file://" + str(directory / "mlruns"))
    experiment = client.get_experiment_by_name("hookloop-test")
    runs = []
    for run in client.search_runs([experiment.experiment_id]):
        run_id = run.info.run_id
        series = {key: sorted((metric.step, metric.value)
                              for metric in client.get_metric_history(run_id, key))
                  for key in run.data.metrics}
        runs.append({"id": run_id, "status": run.info.status, "series": series,
                     "params": run.data.params, "tags": run.data.tags})
    return runs


def wandb_files(directory: Path) -> list[list[dict]]:
    """Every launch's records, read by wandb's own reader, in launch order."""
    files = sorted((directory / "wandb").glob("offline-run-*/run-*.wandb"))
    env = environment()
    out = []
    for path in files:
        result = subprocess.run([console_script("wandb"), "leet", "inspect", "--json", str(path)],
                                env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        out.append([json.loads(line) for line in result.stdout.splitlines() if line.strip()])
    return out


def wandb_series(launches: list[list[dict]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for records in launches:
        for record in records:
            if record["type"] == "history":
                item = record["history"]["item"]
                for key, value in item.items():
                    if not key.startswith("_") and key != "global_step":
                        series.setdefault(key, []).append((item["global_step"], value))
    return {key: sorted(rows) for key, rows in series.items()}


def only(records: list[dict], kind: str) -> list[dict]:
    return [record[kind] for record in records if record["type"] == kind]


# ------------------------------------------------------------------ MLflow
def test_mlflow_run_continues_after_a_kill_and_a_suspension_with_every_step_once(
        tmp_path: Path) -> None:
    """One MLflow run across three launches: killed after step 10 (its checkpoint is of
    step 8, and step 10 was sent after it: the relaunch, which trains 9 and 10 again, must
    not send it twice), a launch ended at step 16 (``stop(resumable=True)``), then the last."""
    assert launch(tmp_path, "mlflow", kill_at=10) == -signal.SIGKILL
    (killed,) = mlflow_runs(tmp_path)
    assert killed["status"] == "RUNNING"
    assert max(step for step, _ in killed["series"]["step/loss"]) == 10
    assert launch(tmp_path, "mlflow", suspend_at=16) == 75
    (suspended,) = mlflow_runs(tmp_path)
    assert suspended["id"] == killed["id"] and suspended["status"] == "RUNNING"
    assert "launch ended at step 16" in suspended["tags"]["hookloop.end_reason"]
    assert launch(tmp_path, "mlflow") == 0
    (run,) = mlflow_runs(tmp_path)  # one run: each relaunch continued it
    assert run["id"] == killed["id"] and run["status"] == "FINISHED"
    assert float32(run["series"]) == tensorboard(tmp_path)  # every step once, TensorBoard's values
    assert [step for step, _ in run["series"]["step/loss"]] == list(range(2, 19, 2))
    assert run["params"]["optimizer.lr"] == "0.1" and run["params"]["Checkpoint.every_n_steps"] == "4"
    assert run["tags"]["hookloop.model"] == "Sequential"
    assert run["tags"]["hookloop.parameters"] == str(5 * 8 + 8 + 8 * 3 + 3)
    assert run["tags"]["hookloop.end_reason"] == "all 3 epochs are done (step 18)"


# ------------------------------------------------------------------ W&B
def test_wandb_offline_run_continues_after_a_kill_and_a_suspension(tmp_path: Path) -> None:
    """One W&B run across three launches: killed after step 10 (checkpoint of step 8), then
    a launch ended at step 14 (``stop(resumable=True)``), then the last one."""
    assert launch(tmp_path, "wandb", kill_at=10) == -signal.SIGKILL
    assert launch(tmp_path, "wandb", suspend_at=14) == 75
    assert launch(tmp_path, "wandb") == 0
    launches = wandb_files(tmp_path)
    assert len(launches) == 3
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len({folder.name.rsplit("-", 1)[1] for folder in folders}) == 1  # one run id
    ids = {only(records, "run")[0]["run_id"] for records in launches[1:]}
    assert ids == {folders[0].name.rsplit("-", 1)[1]}  # the same W&B run, continued
    # W&B holds a launch's records in memory until finish (its file is written in blocks):
    # the killed launch's file has no history and no exit; the relaunch sent it all again.
    assert only(launches[0], "exit") == [] and only(launches[0], "history") == []
    assert only(launches[1], "preempting") != [] and only(launches[1], "exit")[0]["exit_code"] == 75
    assert only(launches[2], "exit")[0].get("exit_code", 0) == 0  # finished
    series = wandb_series(launches)
    assert float32(series) == tensorboard(tmp_path)  # every step once, TensorBoard's values
    config = {}
    for records in launches:
        for update in only(records, "config"):
            config.update(update["update"])
    assert config["optimizer/lr"] == 0.1 and "WandbLogger/run_id" not in config
    summary = {}
    for update in only(launches[2], "summary"):
        summary.update(update.get("update", {}))
    assert summary["end_reason"] == "all 3 epochs are done (step 18)"
