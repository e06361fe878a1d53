"""``log_checkpoints=`` of the trackers (`hookloop.checkpoint_uploads`): read back with the
trackers' own readers (``MlflowClient`` over MLflow's file store; ``wandb leet inspect`` over
an offline run), the uploads are one per new best (the steps where the history's
``val_loss`` beat every earlier one, computed here by hand), each named with its step and
value, each a checkpoint file of that step. (A kill and relaunch:
tests/across_launches/test_kill_and_relaunch_uploads_each_best_once.py.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import hookloop
from hookloop import ConfigurationError, Loop
from hookloop.callbacks import Checkpoint, MLflowLogger, WandbLogger

from conftest import console_script, subprocess_env


def fit(callbacks: list, epochs: int = 5) -> Loop:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(3)]
    val = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), data, val_data=val,
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=callbacks)
    loop.fit(epochs)
    return loop


def new_bests(loop: Loop) -> list[tuple[int, float]]:
    """By hand: the validations whose val_loss beat every earlier one."""
    found: list[tuple[int, float]] = []
    for row in loop.state.history:
        if not found or row["val_loss"] < found[-1][1]:
            found.append((row["step"], row["val_loss"]))
    return found


def test_mlflow_best_uploads_one_artifact_per_new_best(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    uri = "file://" + str(tmp_path / "mlruns")
    tracker = MLflowLogger("e", tracking_uri=uri, log_checkpoints="best")
    loop = fit([tracker, Checkpoint(tmp_path / "ckpt", monitor="val_loss")])
    bests = new_bests(loop)
    assert 2 <= len(bests) < 5  # some validations were not a new best: the test can tell
    client = MlflowClient(uri)
    folders = [entry.path for entry in client.list_artifacts(tracker.run_id, "checkpoints")]
    assert folders == [f"checkpoints/best-step={step:08d}-val_loss={value:.6g}"
                       for step, value in bests]
    for folder, (step, value) in zip(folders, bests):
        (entry,) = client.list_artifacts(tracker.run_id, folder)
        local = client.download_artifacts(tracker.run_id, entry.path, str(tmp_path / "down"))
        payload = hookloop.load_checkpoint(local, nn.Sequential(nn.Linear(3, 8), nn.Tanh(),
                                                                nn.Linear(8, 1)))
        assert payload["step"] == step and payload["metrics"]["val_loss"] == value
    assert [name for name in os.listdir(tmp_path / "ckpt") if name.startswith(".")] == []


def test_mlflow_all_uploads_every_rotating_file_and_best(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    uri = "file://" + str(tmp_path / "mlruns")
    tracker = MLflowLogger("e", tracking_uri=uri, log_checkpoints="all")
    loop = fit([tracker, Checkpoint(tmp_path / "ckpt", monitor="val_loss", keep_last=1)], 3)
    client = MlflowClient(uri)
    folders = {entry.path.split("/")[1]: [item.path.split("/")[-1] for item in
                                          client.list_artifacts(tracker.run_id, entry.path)]
               for entry in client.list_artifacts(tracker.run_id, "checkpoints")}
    rows = loop.state.history
    rotating = {f"step={row['step']:08d}-val_loss={row['val_loss']:.6g}":
                [f"epoch={epoch:04d}-step={row['step']:08d}.pt"] for epoch, row in enumerate(rows)}
    best = {f"best-step={step:08d}-val_loss={value:.6g}": ["best.pt"]
            for step, value in new_bests(loop)}
    assert folders == {**rotating, **best}  # keep_last=1 pruned none before its upload


def test_bad_log_checkpoints_are_refused_by_name(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = "file://" + str(tmp_path / "mlruns")
    with pytest.raises(ConfigurationError, match="log_checkpoints must be 'best'.*got 'some'"):
        MLflowLogger(log_checkpoints="some")
    with pytest.raises(ConfigurationError, match="log_checkpoints='best'.*Checkpoint\\(dirpath, "
                                                 "monitor='val_loss'\\)"):
        fit([MLflowLogger(tracking_uri=uri, log_checkpoints="best"),
             Checkpoint(tmp_path / "ckpt")], 1)
    with pytest.raises(ConfigurationError, match="log_checkpoints='all'.*the stack has none"):
        fit([MLflowLogger(tracking_uri=uri, log_checkpoints="all")], 1)


@pytest.mark.slow
def test_wandb_offline_best_uploads_one_artifact_version_per_new_best(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbLogger("p", dir=tmp_path, mode="offline", log_checkpoints="best")
    loop = fit([tracker, Checkpoint(tmp_path / "ckpt", monitor="val_loss")])
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    read = subprocess.run([console_script("wandb"), "leet", "inspect", "--json", str(path)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    records = [json.loads(line) for line in read.stdout.splitlines() if line.strip()]
    artifacts = [record["artifact"] for record in records if record["type"] == "artifact"]
    bests = new_bests(loop)
    assert [a["name"] for a in artifacts] == [f"checkpoints-{tracker.run_id}"] * len(bests)
    names = [f"best-step={step:08d}-val_loss={value:.6g}" for step, value in bests]
    assert [[alias for alias in a["aliases"] if alias.startswith("best-")]
            for a in artifacts] == [[name] for name in names]
    assert [json.loads(a["metadata"])["step"] for a in artifacts] == [s for s, _ in bests]
    assert all([entry["path"] for entry in a["manifest"]["contents"]] == ["best.pt"]
               for a in artifacts)


def test_mlflow_failed_uploads_are_retried_and_the_unsent_named_at_fit_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    copy, calls = MlflowClient.log_artifact, []

    def flaky(self, run_id, local_path, artifact_path=None):  # the first two tries fail
        calls.append(artifact_path)
        if len(calls) <= 2:
            raise ConnectionError("store unreachable")
        return copy(self, run_id, local_path, artifact_path)

    monkeypatch.setattr(MlflowClient, "log_artifact", flaky)
    uri = "file://" + str(tmp_path / "mlruns")
    tracker = MLflowLogger("e", tracking_uri=uri, log_checkpoints="best")
    with pytest.warns(RuntimeWarning, match="tried again later"):
        loop = fit([tracker, Checkpoint(tmp_path / "ckpt", monitor="val_loss")])
    folders = [entry.path for entry in MlflowClient(uri).list_artifacts(tracker.run_id,
                                                                        "checkpoints")]
    assert folders == sorted(f"checkpoints/best-step={step:08d}-val_loss={value:.6g}"
                             for step, value in new_bests(loop))
    assert "did not upload" not in capsys.readouterr().out
    assert [name for name in os.listdir(tmp_path / "ckpt") if name.startswith(".")] == []

    def down(self, run_id, local_path, artifact_path=None):
        raise ConnectionError("store unreachable")

    monkeypatch.setattr(MlflowClient, "log_artifact", down)
    tracker = MLflowLogger("e", tracking_uri=uri, log_checkpoints="best")
    with pytest.warns(RuntimeWarning):
        loop = fit([tracker, Checkpoint(tmp_path / "ckpt2", monitor="val_loss")])
    names = [f"best-step={step:08d}-val_loss={value:.6g}" for step, value in new_bests(loop)]
    out = capsys.readouterr().out
    assert f"did not upload {len(names)} checkpoint(s) ({', '.join(names)})" in out
    assert "ConnectionError: store unreachable" in out
    assert sorted(os.listdir(tmp_path / "ckpt2" / f".upload-{tracker.run_id}-{names[0]}")) == \
        ["best.pt", "upload.json"]  # kept for the relaunch
