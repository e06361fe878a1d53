"""MLflowLogger in process: a tracker that fails never changes training and warns once; values
kept through failures are sent later, each once; read back with MlflowClient from a local
file store. (Kill, relaunch and suspension: tests/across_launches/
test_kill_and_relaunch_continues_the_tracker_run.py.)"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from hookloop import ConfigurationError, presets
from hookloop.callbacks import MLflowLogger

from builders import dropout_loop, weights

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture(autouse=True)
def file_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def history(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(uri)
    return {key: sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, key))
            for key in client.get_run(run_id).data.metrics}


def tracked_fit(tmp_path: Path, name: str, **options) -> tuple[MLflowLogger, dict, str]:
    uri = f"file://{tmp_path / name}"
    tracker = MLflowLogger("test", tracking_uri=uri, every_n_steps=2, **options)
    loop = dropout_loop([tracker], batches=5)
    loop.fit(2)
    return tracker, weights(loop), uri


def test_a_tracker_failing_at_every_call_changes_nothing_and_warns_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    reference = dropout_loop([], batches=5)
    reference.fit(2)
    capsys.readouterr()
    # A server nobody listens on: a real connection failure at every call.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    tracker = MLflowLogger("test", tracking_uri="http://127.0.0.1:9", every_n_steps=1)
    loop = dropout_loop([tracker], batches=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.fit(2)
    ours = [w for w in caught if "MLflowLogger" in str(w.message)]
    assert len(ours) == 1 and "127.0.0.1:9" in str(ours[0].message)
    for name, value in weights(reference).items():
        assert (weights(loop)[name] == value).all()
    out = capsys.readouterr().out
    assert "MLflowLogger did not send" in out and "steps 1 to 10" in out
    state = tracker.state_dict()  # kept for the relaunch, in order
    assert [row[0] for row in state["pending"]][:3] == [1, 2, 3] and state["run_id"] is None


def test_values_kept_through_failures_are_sent_once_when_it_recovers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, reference_uri = tracked_fit(tmp_path, "reference")
    (reference_run,) = MlflowClient(reference_uri).search_runs(
        [MlflowClient(reference_uri).get_experiment_by_name("test").experiment_id])

    real, calls = MlflowClient.log_batch, {"n": 0}

    def flaky(self, *args, **kwargs):  # a crash inside the library, three times
        calls["n"] += 1
        if 3 <= calls["n"] <= 5:
            raise RuntimeError("quota exceeded")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", flaky)
    with pytest.warns(RuntimeWarning, match="MLflowLogger.*quota exceeded"):
        tracker, _, uri = tracked_fit(tmp_path, "flaky")
    assert calls["n"] > 5 and tracker.state_dict()["pending"] == []
    assert history(uri, tracker.run_id) == history(reference_uri, reference_run.info.run_id)
    run = MlflowClient(uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer.lr"] == "0.05"


def test_a_second_fit_continues_the_same_run(tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'store'}"
    tracker = MLflowLogger("test", tracking_uri=uri, every_n_steps=2)
    loop = dropout_loop([tracker], batches=5)
    loop.fit(1)
    first = tracker.run_id
    loop.fit(2)
    assert tracker.run_id == first
    steps = [step for step, _ in history(uri, first)["step/loss"]]
    assert steps == [2, 4, 6, 8, 10]


def test_the_standard_preset_takes_a_tracker_and_has_none_by_default() -> None:
    quiet = {"tensorboard": None, "progress": False, "checkpoint_dir": None}
    assert not any(isinstance(callback, MLflowLogger) for callback in presets.standard(**quiet))
    stack = presets.standard(tracker="mlflow", **quiet)
    assert sum(isinstance(callback, MLflowLogger) for callback in stack) == 1
    with pytest.raises(ConfigurationError, match="tracker"):
        presets.standard(tracker="neptune", **quiet)


def test_no_host_read_on_the_steps_it_does_not_log(tmp_path: Path, count_reads) -> None:
    """Like TensorBoard: reads grow by at most one per logging interval (one stacked read of
    the step's values), never per batch."""
    def reads(batches: int) -> int:
        tracker = MLflowLogger("test", tracking_uri=f"file://{tmp_path / str(batches)}",
                               every_n_steps=10)
        loop = dropout_loop([tracker], batches=batches)
        before = count_reads["n"]
        loop.fit(2)
        return count_reads["n"] - before

    small, large = reads(10), reads(60)
    assert large - small <= 2 * 50 // 10, (small, large)
