"""WandbLogger in process: W&B failing at every call changes nothing and warns once; a fit
offline is read back with W&B's own reader (``wandb leet inspect --json``). (Kill, relaunch
and suspension: tests/across_launches/test_kill_and_relaunch_continues_the_tracker_run.py.)"""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import pytest

from hookloop import presets
from hookloop.callbacks import TensorBoard, WandbLogger

from builders import dropout_loop, weights
from conftest import console_script, subprocess_env

wandb = pytest.importorskip("wandb")


def test_wandb_failing_at_every_call_changes_nothing_and_warns_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    reference = dropout_loop([], batches=5)
    reference.fit(2)
    capsys.readouterr()

    def broken(*args, **kwargs):
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(wandb, "init", broken)
    loop = dropout_loop([WandbLogger("p", every_n_steps=1)], batches=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit(2)
    ours = [w for w in caught if "WandbLogger" in str(w.message)]
    assert len(ours) == 1 and "api.wandb.ai unreachable" in str(ours[0].message)
    assert all((weights(loop)[name] == value).all() for name, value in weights(reference).items())
    assert "WandbLogger did not send" in capsys.readouterr().out


@pytest.mark.slow
def test_an_offline_fit_reads_back_as_tensorboard_logged_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbLogger("p", dir=tmp_path, mode="offline", every_n_steps=2)
    loop = dropout_loop([tracker, TensorBoard(tmp_path / "tb", every_n_steps=2)], batches=5)
    loop.fit(2)
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    read = subprocess.run([console_script("wandb"), "leet", "inspect", "--json", str(path)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    records = [json.loads(line) for line in read.stdout.splitlines() if line.strip()]
    rows = [record["history"]["item"] for record in records if record["type"] == "history"]
    steps = [row["global_step"] for row in rows if "step/loss" in row]
    assert steps == [2, 4, 6, 8, 10]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    expected = [(event.step, event.value) for event in accumulator.Scalars("metrics/val_loss")]
    got = [(row["global_step"], row["metrics/val_loss"]) for row in rows if "metrics/val_loss" in row]
    assert [step for step, _ in got] == [step for step, _ in expected] == [5, 10]
    assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=1e-6)
    (run,) = [record["run"] for record in records if record["type"] == "run"]
    assert run["run_id"] == tracker.run_id
    (exit_record,) = [record["exit"] for record in records if record["type"] == "exit"]
    assert exit_record.get("exit_code", 0) == 0


def test_the_standard_preset_names_wandb() -> None:
    stack = presets.standard(tracker="wandb", tensorboard=None, progress=False, checkpoint_dir=None)
    assert sum(isinstance(callback, WandbLogger) for callback in stack) == 1
