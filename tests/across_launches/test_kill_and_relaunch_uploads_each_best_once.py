"""``log_checkpoints="best"`` across a SIGKILL: a child process trains with a tracker and a
monitoring ``Checkpoint`` (rotating files every 4 steps, a validation every 2), is killed at
step 7 once the best of step 6 was handed to the tracker, and is relaunched with
``Checkpoint(resume=True)``; the relaunch trains steps 5 and 6 again and finds that best
again. The tracker's own reader (``MlflowClient``; ``wandb leet inspect --json`` over every
launch's offline file) shows each new best of an uninterrupted run (the oracle: the same
script, never killed) uploaded once, none twice, in order: also the W&B offline bests whose
records the killed launch's file lost with its last block, and an MLflow upload the kill
cut in the middle of its copy ("mlflow-cut": the kill comes from inside the copy)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import console_script, subprocess_env

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

SCRIPT = r'''
import os, signal, sys
import torch
import torch.nn.functional as F
from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, MLflowLogger, WandbLogger

directory, kind, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
train = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
         for _ in range(4)]
val = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))]
model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
if kind == "mlflow-cut":  # the copy of best 6 stops half-way: the process is killed
    from mlflow.tracking import MlflowClient
    copy = MlflowClient.log_artifact
    def cut(self, run_id, local_path, artifact_path=None):
        if "step=00000006" not in (artifact_path or ""):
            return copy(self, run_id, local_path, artifact_path)
        root = self.get_run(run_id).info.artifact_uri.replace("file://", "", 1)
        target = os.path.join(root, artifact_path, os.path.basename(local_path))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(local_path, "rb") as source, open(target, "wb") as part:
            part.write(source.read()[:200])
        os.kill(os.getpid(), signal.SIGKILL)
    MlflowClient.log_artifact = cut
if kind.startswith("mlflow"):
    tracker = MLflowLogger("hookloop-test", log_checkpoints="best",
                           tracking_uri="file://" + os.path.join(directory, "mlruns"))
else:
    tracker = WandbLogger("hookloop-test", dir=directory, mode="offline", log_checkpoints="best")

class Kill(Callback):
    def on_batch_end(self, loop):
        if loop.state.step == kill_at:
            tracker._uploads.wait()  # the best of step 6 is in the tracker: now the kill
            os.kill(os.getpid(), signal.SIGKILL)

loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), train, val_data=val,
            loss_fn=F.mse_loss, device="cpu", val_every_n_steps=2,
            callbacks=[tracker, Checkpoint(os.path.join(directory, "ckpt"), monitor="val_loss",
                                           every_n_steps=4, every_n_epochs=None, resume=True),
                       Kill()])
loop.fit(3)
print("BESTS", [row["step"] for row in loop.state.history])
'''


def environment() -> dict[str, str]:
    env = subprocess_env()
    env.update(MLFLOW_ALLOW_FILE_STORE="true", WANDB_SILENT="true", WANDB_MODE="offline")
    return env


def launch(directory: Path, kind: str, kill_at: int = -1) -> int:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(directory), kind, str(kill_at)],
                            env=environment(), capture_output=True, text=True, timeout=300)
    if result.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(result.stderr[-4000:])
    assert "RuntimeWarning" not in result.stderr, result.stderr[-3000:]
    return result.returncode


def mlflow_uploads(directory: Path, load: bool = False) -> list[str]:
    """The uploads' names; ``load``: each file downloaded and read by hookloop (a partial
    copy cannot be read), its step the one its name says."""
    import torch
    from mlflow.tracking import MlflowClient

    import hookloop

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient("file://" + str(directory / "mlruns"))
    experiment = client.get_experiment_by_name("hookloop-test")
    (run,) = client.search_runs([experiment.experiment_id])
    names = [entry.path.split("/")[-1]
             for entry in client.list_artifacts(run.info.run_id, "checkpoints")]
    for name in names if load else ():
        (entry,) = client.list_artifacts(run.info.run_id, f"checkpoints/{name}")
        local = client.download_artifacts(run.info.run_id, entry.path, str(directory / name))
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        payload = hookloop.load_checkpoint(local, model)
        assert f"step={payload['step']:08d}" in name, (name, payload["step"])
    return names


def wandb_uploads(directory: Path) -> list[str]:
    names = []
    for path in sorted((directory / "wandb").glob("offline-run-*/run-*.wandb")):
        result = subprocess.run([console_script("wandb"), "leet", "inspect", "--json", str(path)],
                                env=environment(), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        for line in result.stdout.splitlines():
            record = json.loads(line) if line.strip() else {}
            if record.get("type") == "artifact":
                names += [alias for alias in record["artifact"]["aliases"]
                          if alias.startswith("best-")]
    return names


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlflow", "mlflow-cut", "wandb"])
def test_each_new_best_is_uploaded_once_across_a_kill_and_relaunch(tmp_path: Path,
                                                                    kind: str) -> None:
    read = wandb_uploads if kind == "wandb" else mlflow_uploads
    assert launch(tmp_path / "reference", kind if kind != "mlflow-cut" else "mlflow") == 0
    expected = read(tmp_path / "reference")
    assert len(expected) >= 3 and "best-step=00000006" in " ".join(expected)
    assert launch(tmp_path / "run", kind, kill_at=7) == -signal.SIGKILL
    best_6 = [name for name in expected if "step=00000006" in name][0]
    if kind.startswith("mlflow"):  # the killed launch's upload is in the store (cut: a part)
        assert best_6 in read(tmp_path / "run")
    if kind == "mlflow-cut":
        with pytest.raises(Exception):
            read(tmp_path / "run", load=True)  # the oracle tells a partial file
    assert launch(tmp_path / "run", "mlflow" if kind == "mlflow-cut" else kind) == 0
    uploads = read(tmp_path / "run")
    # In order, each once: with W&B offline too, where the killed launch's file lost its last
    # block and the records of bests 2, 4 and 6 with it (their staged links are uploaded again).
    assert uploads == expected
    if kind.startswith("mlflow"):
        read(tmp_path / "run", load=True)  # every file whole
    assert not [name for name in os.listdir(tmp_path / "run" / "ckpt") if name.startswith(".")]
