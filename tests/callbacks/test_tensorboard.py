"""TensorBoard: event files read back with tensorboard's own EventAccumulator, checked against
what the loop computed (recorded by a test callback) and against a closed-form schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import AMP, Checkpoint, GradClip, LRScheduler, Metrics, TensorBoard

from builders import (Crash, RaiseAfterStep, StepRecorder, ValidationSteps, accuracy,
                      classification_batches, two_layers)
from builders import make_loop as build_loop

BATCHES, EPOCHS = 7, 3


def make_loop(callbacks: list[Callback], *, val: bool = True) -> Loop:
    return build_loop(callbacks,
                      model=lambda: two_layers(5, 8, 3, torch.nn.BatchNorm1d(8), torch.nn.ReLU()),
                      train=classification_batches(BATCHES, seed=1), val=slice(3) if val else None,
                      loss_fn=F.cross_entropy)


def events(log_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def scalars(accumulator: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_losses_lrs_and_grad_norms_are_the_loop_values(tmp_path: Path) -> None:
    recorder = StepRecorder()
    schedule = LRScheduler(lambda opt, total: torch.optim.lr_scheduler.StepLR(opt, 4, gamma=0.5))
    loop = make_loop([GradClip(1.0), schedule, TensorBoard(tmp_path, every_n_steps=3), recorder])
    loop.fit(EPOCHS)
    accumulator = events(tmp_path)
    logged_steps = list(range(3, BATCHES * EPOCHS + 1, 3))
    losses = scalars(accumulator, "step/loss")
    assert [step for step, _ in losses] == logged_steps
    for step, value in losses:  # float32 in the event file
        assert value == pytest.approx(recorder.loss[step], rel=1e-6)
    for step, value in scalars(accumulator, "step/grad_norm"):
        assert value == pytest.approx(recorder.grad_norm[step], rel=1e-6)
    lrs = scalars(accumulator, "step/lr")
    assert [step for step, _ in lrs] == logged_steps
    for step, value in lrs:  # StepLR(4, 0.5) stepped once per optimizer step: closed form
        assert value == pytest.approx(0.1 * 0.5 ** (step // 4), rel=1e-6)
        assert value == pytest.approx(recorder.lr[step], rel=1e-6)


def test_validation_metrics_once_per_validation_and_hparams(tmp_path: Path) -> None:
    recorder = StepRecorder()
    loop = make_loop([Metrics(acc=accuracy), TensorBoard(tmp_path, every_n_steps=50), recorder])
    state = loop.fit(EPOCHS)
    accumulator = events(tmp_path)
    for name in ("val_loss", "val_acc", "train_loss"):
        logged = scalars(accumulator, f"metrics/{name}")
        expected = [(step, metrics[name]) for step, metrics in recorder.validations]
        assert [step for step, _ in logged] == [step for step, _ in expected]
        assert [value for _, value in logged] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert len(recorder.validations) == EPOCHS
    content = accumulator.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    params = start.session_start_info.hparams
    assert params["optimizer"].string_value == "SGD"
    assert params["lr"].number_value == pytest.approx(0.1)
    assert params["epochs"].number_value == EPOCHS
    assert params["0.Metrics"].string_value == "Metrics(acc)"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    metric_tags = {info.name.tag for info in experiment.experiment.metric_infos}
    assert {"metrics/val_loss", "metrics/val_acc", "metrics/train_loss"} <= metric_tags
    # the metric tags hold the final values at the final step (a real number, not -1)
    assert scalars(accumulator, "metrics/val_loss")[-1] == (
        state.step, pytest.approx(state.metrics["val_loss"], rel=1e-6))


def test_given_hparams_and_epoch_metrics_without_validation(tmp_path: Path) -> None:
    loop = make_loop([TensorBoard(tmp_path, hparams={"width": 8, "note": "x"})], val=False)
    loop.fit(2)
    accumulator = events(tmp_path)
    assert [step for step, _ in scalars(accumulator, "metrics/train_loss")] == [7, 14]
    content = accumulator.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert dict(start.session_start_info.hparams)["width"].number_value == 8
    assert "optimizer" not in start.session_start_info.hparams


def test_histograms_and_graph_when_asked_and_not_otherwise(tmp_path: Path) -> None:
    loop = make_loop([TensorBoard(tmp_path / "on", histograms_every_n_epochs=2, graph=True)])
    before = [b.clone() for b in loop.model.buffers()]
    loop.fit(EPOCHS)
    accumulator = events(tmp_path / "on")
    tags = accumulator.Tags()
    assert tags["graph"] is True
    assert "weights/0.weight" in tags["histograms"] and "gradients/0.weight" in tags["histograms"]
    # every 2nd epoch (epoch index 1), at its last step
    assert [event.step for event in accumulator.Histograms("gradients/3.bias")] == [2 * BATCHES]
    assert any(not torch.equal(a, b) for a, b in zip(before, loop.model.buffers()))  # trained

    plain = make_loop([TensorBoard(tmp_path / "off")])
    plain.fit(1)
    tags = events(tmp_path / "off").Tags()
    assert tags["graph"] is False and tags["histograms"] == []


def test_graph_changes_nothing_of_the_run(tmp_path: Path) -> None:
    with_graph = make_loop([TensorBoard(tmp_path / "a", graph=True)])
    with_graph.fit(1)
    without = make_loop([])
    without.fit(1)
    for a, b in zip(with_graph.model.state_dict().values(), without.model.state_dict().values()):
        assert torch.equal(a, b)


def test_untraceable_model_warns_and_trains(tmp_path: Path) -> None:
    class Boom(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(5, 3)

        def forward(self, x):
            if not torch.jit.is_tracing():
                return self.linear(x)
            raise RuntimeError("cannot trace me")

    model = Boom()
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,)))]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
                callbacks=[TensorBoard(tmp_path, graph=True)], device="cpu")
    with pytest.warns(RuntimeWarning, match="could not trace"):
        assert loop.fit(1).step == 1


def test_amp_loss_scale_is_logged(tmp_path: Path) -> None:
    amp = AMP(torch.float16, scaler={"init_scale": 256.0})
    loop = make_loop([amp, TensorBoard(tmp_path, every_n_steps=1)], val=False)
    loop.fit(1)
    scales = scalars(events(tmp_path), "step/loss_scale")
    assert len(scales) == loop.state.step and scales[-1][1] == amp.scaler.get_scale()


def test_closed_on_exception_and_no_hparams(tmp_path: Path) -> None:
    class Fail(Callback):
        def after_step(self, loop: Loop) -> None:
            if loop.state.step == 5:
                raise Crash()

    board = TensorBoard(tmp_path, every_n_steps=1)
    with pytest.raises(Crash):
        make_loop([board, Fail()]).fit(2)
    assert board._writer is None  # closed
    accumulator = events(tmp_path)
    assert [step for step, _ in scalars(accumulator, "step/loss")] == [1, 2, 3, 4, 5]
    with pytest.raises(KeyError):  # an unfinished run has no final metrics: no HPARAMS entry
        accumulator.PluginTagToContent("hparams")


def test_writer_is_reachable_by_other_callbacks(tmp_path: Path) -> None:
    board = TensorBoard(tmp_path)

    class Images(Callback):
        def on_epoch_end(self, loop: Loop) -> None:
            board.writer.add_image("inputs", torch.rand(3, 4, 4), loop.state.step)

    make_loop([board, Images()]).fit(1)
    assert events(tmp_path).Tags()["images"] == ["inputs"]
    with pytest.raises(RuntimeError, match="only during fit"):
        board.writer


def test_bad_arguments() -> None:
    with pytest.raises(ConfigurationError, match="every_n_steps"):
        TensorBoard(every_n_steps=0)
    with pytest.raises(ConfigurationError, match="hparams"):
        TensorBoard(hparams=[("lr", 1)])


# every=7: the checkpoint at step 7 (or 14) is taken before that epoch's validation, which the
# resumed run does again: the purge at the resumed step must not keep two copies, nor lose the
# step's loss, logged before the checkpoint.
@pytest.mark.parametrize(("every", "crash_step"), [(4, 10), (7, 10), (7, 14)])
def test_exception_after_checkpoint_then_resume_logs_each_step_once(tmp_path: Path, every: int,
                                                                   crash_step: int) -> None:
    reference = make_loop([TensorBoard(tmp_path / "reference", every_n_steps=1)])
    reference.fit(EPOCHS)
    expected = events(tmp_path / "reference")

    run, checkpoints = tmp_path / "run", tmp_path / "checkpoints"
    with pytest.raises(Crash):
        make_loop([TensorBoard(run, every_n_steps=1),
                   Checkpoint(checkpoints, every_n_steps=every),
                   RaiseAfterStep(crash_step)]).fit(EPOCHS)
    make_loop([TensorBoard(run, every_n_steps=1),
               Checkpoint(checkpoints, every_n_steps=every, resume=True)]
              ).fit(EPOCHS)
    resumed = events(run)
    for tag in ("step/loss", "step/lr", "metrics/val_loss", "metrics/train_loss"):
        got, want = scalars(resumed, tag), scalars(expected, tag)
        assert [s for s, _ in got] == [s for s, _ in want], tag  # each step exactly once
        assert [v for _, v in got] == [v for _, v in want], tag  # exact resume


def test_val_metrics_once_per_validation_with_step_cadence(tmp_path: Path) -> None:
    """Validation every 3 steps, 7 batches an epoch: the epoch ends (steps 7, 14) did not
    validate, so they must not log the previous validation's val_loss again (the loop's
    history leaves it out of those rows too), not even at fit end with the hparams."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(7)]
    seen = ValidationSteps()  # sanity_val_batches=0: each validation is one of the fit's
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:2],
                loss_fn=F.cross_entropy, device="cpu", val_every_n_epochs=None,
                val_every_n_steps=3, sanity_val_batches=0,
                callbacks=[seen, TensorBoard(tmp_path, every_n_steps=50)])
    loop.fit(2)
    accumulator = events(tmp_path)
    assert seen.steps == [3, 6, 9, 12]
    assert [row["step"] for row in loop.state.history if "val_loss" in row] == [3, 6, 9, 12]
    assert [step for step, _ in scalars(accumulator, "metrics/val_loss")] == seen.steps
    assert [step for step, _ in scalars(accumulator, "metrics/train_loss")] == [7, 14]


def make_histogram_loop(log_dir: Path, checkpoints: Path, resume: bool) -> Loop:
    return build_loop([TensorBoard(log_dir, every_n_steps=7, histograms_every_n_epochs=1),
                       Checkpoint(checkpoints, resume=resume)],
                      model=lambda: torch.nn.Linear(5, 3),
                      train=classification_batches(BATCHES, seed=1), val=slice(2),
                      loss_fn=F.cross_entropy)


def test_histograms_of_the_resumed_step_survive_its_purge(tmp_path: Path) -> None:
    """The resumed writer purges the resumed step (step 14, where the first run logged its
    scalars and histograms): the weight and gradient histograms of that step are written
    again, identical to an uninterrupted run's."""
    make_histogram_loop(tmp_path / "reference", tmp_path / "reference_ckpt", False).fit(3)
    make_histogram_loop(tmp_path / "run", tmp_path / "ckpt", False).fit(2)
    make_histogram_loop(tmp_path / "run", tmp_path / "ckpt", True).fit(3)  # one more epoch
    reference, resumed = events(tmp_path / "reference"), events(tmp_path / "run")
    for tag in ("weights/weight", "weights/bias", "gradients/weight", "gradients/bias"):
        want, got = reference.Histograms(tag), resumed.Histograms(tag)
        assert [event.step for event in want] == [7, 14, 21]
        assert [event.step for event in got] == [7, 14, 21], tag
        for w, g in zip(want, got):
            assert g.histogram_value == w.histogram_value, (tag, w.step)
    assert [s for s, _ in scalars(resumed, "step/loss")] == [7, 14, 21]
