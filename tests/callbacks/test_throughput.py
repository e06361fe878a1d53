"""ThroughputMonitor against hand computations: samples and tokens counted over a scripted
clock, validation time left out, FLOPs of Linear layers counted by hand, no host sync per
batch, and the values where the views read them."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hookloop import Callback, ConfigurationError, Loop
import hookloop.callbacks.throughput as throughput
from hookloop.callbacks import (
    CSVLogger,
    GradAccumulation,
    ProgressBar,
    TensorBoard,
    ThroughputMonitor,
)


class Clock:
    """A perf_counter that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


class Work(Callback):
    """Every training batch takes ``seconds`` (after its backward); every validation batch
    ``validation_seconds``, which must not count."""

    def __init__(self, clock: Clock, seconds: float, validation_seconds: float = 0.0) -> None:
        self.clock, self.seconds, self.validation_seconds = clock, seconds, validation_seconds

    def after_backward(self, loop) -> None:
        self.clock.now += self.seconds

    def on_validation_batch_end(self, loop) -> None:
        self.clock.now += self.validation_seconds


class Reports(Callback):
    """The monitor's metrics as they are after every step and at the epoch's end."""

    def __init__(self) -> None:
        self.at_step: dict[int, dict[str, float]] = {}
        self.epoch_end: list[dict[str, float]] = []

    def after_step(self, loop) -> None:
        self.at_step[loop.state.step] = {key: value for key, value in loop.state.metrics.items()
                                            if key != "train_loss"}

    def on_epoch_end(self, loop) -> None:
        self.epoch_end.append(dict(loop.state.metrics))


def batches(sizes: list[int], width: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(size, width, generator=generator),
             torch.randint(0, 3, (size,), generator=generator)) for size in sizes]


def make_loop(data, callbacks, *, model: torch.nn.Module | None = None, **kwargs) -> Loop:
    torch.manual_seed(0)
    model = model if model is not None else torch.nn.Linear(6, 3)
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=F.cross_entropy, callbacks=callbacks, device="cpu", **kwargs)


def test_samples_and_batches_per_second_per_interval(clock: Clock) -> None:
    sizes = [8] * 10 + [3]  # 11 batches, 83 samples
    reports = Reports()
    loop = make_loop(batches(sizes), [Work(clock, 0.5), ThroughputMonitor(every_n_steps=4),
                                      reports])
    state = loop.fit(1)
    # Steps 1-4 and 5-8: 4 batches of 8 in 4 x 0.5 s; then 8 + 8 + 3 samples in 1.5 s.
    assert reports.at_step[4] == {"samples_per_s": 32 / 2.0, "batches_per_s": 4 / 2.0}
    assert reports.at_step[8] == {"samples_per_s": 32 / 2.0, "batches_per_s": 4 / 2.0}
    assert state.metrics["samples_per_s"] == pytest.approx(19 / 1.5)
    assert state.metrics["batches_per_s"] == pytest.approx(3 / 1.5)


def test_accumulation_counts_micro_batches_and_validation_time_is_left_out(clock: Clock) -> None:
    sizes = [8] * 8
    reports = Reports()
    # A validation after step 1 (10 s per batch, 2 batches) falls inside the first interval.
    loop = make_loop(batches(sizes), [GradAccumulation(2), Work(clock, 0.25, 10.0),
                                      ThroughputMonitor(every_n_steps=2), reports],
                     val_data=batches([4, 4]), val_every_n_steps=1, val_every_n_epochs=None,
                     sanity_val_batches=0)
    loop.fit(1)
    # Step 2 ends batch 3: 4 batches of 8 in 4 x 0.25 s of training.
    assert reports.at_step[2]["samples_per_s"] == pytest.approx(32 / 1.0)
    assert reports.at_step[2]["batches_per_s"] == pytest.approx(4 / 1.0)
    assert reports.at_step[4]["samples_per_s"] == pytest.approx(32 / 1.0)


def test_tokens_per_second_from_an_int_or_a_device_tensor(clock: Clock) -> None:
    sizes = [8, 8, 5]
    for tokens in (lambda batch: batch[0].shape[0] * 7,          # from shapes
                   lambda batch: (batch[1] >= 0).sum() * 7):     # a tensor, read per report
        loop = make_loop(batches(sizes), [Work(clock, 2.0),
                                          ThroughputMonitor(every_n_steps=100, tokens=tokens)])
        metrics = loop.fit(1).metrics
        assert metrics["tokens_per_s"] == pytest.approx(21 * 7 / 6.0)
        assert metrics["samples_per_s"] == pytest.approx(21 / 6.0)


@pytest.mark.parametrize("hidden", [None, 16], ids=["linear", "mlp"])
def test_flops_of_linear_layers_measured_once_as_by_hand(clock: Clock, hidden: int | None) -> None:
    if hidden is None:
        model: torch.nn.Module = torch.nn.Linear(6, 3)
        # forward 2*6*3; backward: the weight's gradient 2*6*3 (inputs need no gradient).
        by_hand = 2 * 6 * 3 + 2 * 6 * 3
    else:
        model = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, 3))
        # Layer 1: forward and weight gradient; layer 2: forward, weight and input gradients.
        by_hand = 2 * (2 * 6 * hidden) + 3 * (2 * hidden * 3)
    monitor = ThroughputMonitor(every_n_steps=100, flops_per_sample="measure", peak_flops=1e4)
    loop = make_loop(batches([8, 8, 8, 4]), [Work(clock, 1.0), monitor], model=model)
    metrics = loop.fit(1).metrics
    assert monitor.flops_per_sample == by_hand
    # The counted first batch is not timed: 8 + 8 + 4 samples in 3 s.
    assert metrics["samples_per_s"] == pytest.approx(20 / 3.0)
    assert metrics["mfu"] == pytest.approx(by_hand * (20 / 3.0) / 1e4)


def test_given_flops_per_sample_are_used_as_they_are(clock: Clock) -> None:
    monitor = ThroughputMonitor(every_n_steps=2, flops_per_sample=1000.0, peak_flops=4000.0)
    metrics = make_loop(batches([4, 4]), [Work(clock, 1.0), monitor]).fit(1).metrics
    assert metrics["mfu"] == pytest.approx(1000.0 * (8 / 2.0) / 4000.0)


def test_no_host_read_per_batch(count_reads) -> None:
    def reads(n: int) -> int:
        monitor = ThroughputMonitor(every_n_steps=1000, tokens=lambda batch: (batch[1] >= 0).sum())
        loop = make_loop(batches([4] * n), [monitor])
        before = count_reads["n"]
        loop.fit(1)
        return count_reads["n"] - before

    # One read of the training loss, one of the tokens (the epoch's one report).
    assert reads(3) == reads(30) <= 3


def test_the_views_show_the_values(tmp_path: Path) -> None:
    console = Console(file=io.StringIO(), force_terminal=False, width=300)
    loop = make_loop(batches([8] * 6), [ThroughputMonitor(every_n_steps=2),
                                        ProgressBar(console=console),
                                        CSVLogger(tmp_path / "log.csv"),
                                        TensorBoard(tmp_path / "tb")],
                     val_data=batches([8]))
    state = loop.fit(2)
    rows = [(row["step"], row["samples_per_s"]) for row in state.history]
    assert [step for step, _ in rows] == [6, 12] and all(value > 0 for _, value in rows)
    assert "samples_per_s" in console.file.getvalue()
    frame = pd.read_csv(tmp_path / "log.csv")
    assert list(frame[frame.kind == "history"]["samples_per_s"]) == [value for _, value in rows]
    accumulator = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    logged = [(event.step, event.value) for event in accumulator.Scalars("metrics/samples_per_s")]
    assert logged == [(step, pytest.approx(value)) for step, value in rows]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="ThroughputMonitor every_n_steps must be an int"):
        ThroughputMonitor(every_n_steps=0)
    with pytest.raises(ConfigurationError, match="ThroughputMonitor tokens must be a function"):
        ThroughputMonitor(tokens=5)
    with pytest.raises(ConfigurationError, match="ThroughputMonitor flops_per_sample must be"):
        ThroughputMonitor(flops_per_sample="count")
    with pytest.raises(ConfigurationError, match="ThroughputMonitor peak_flops must be"):
        ThroughputMonitor(peak_flops=-1.0)


class Timed(torch.nn.Module):
    """A Linear(6, 3) whose every forward takes ``seconds`` of the fake clock."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds, self.linear = clock, seconds, torch.nn.Linear(6, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.seconds
        return self.linear(inputs)


def test_validate_evaluate_and_predict_are_measured_each_as_a_pass(clock: Clock) -> None:
    monitor = ThroughputMonitor(every_n_steps=100, tokens=lambda batch: batch[0].shape[0] * 5,
                                flops_per_sample=300.0, peak_flops=1000.0)
    loop = make_loop(batches([8, 8]), [monitor], model=Timed(clock, 0.5),
                     val_data=batches([4, 4, 2]), sanity_val_batches=0)
    state = loop.fit(1)
    # Inside fit the validation is not measured; training is 16 samples in 2 x 0.5 s.
    assert state.metrics["samples_per_s"] == pytest.approx(16.0)
    assert not any(name.startswith("val_") and name != "val_loss" for name in state.history[0])
    # A pass: its first batch to its end, 3 forwards of 0.5 s; its MFU counts the forward
    # only (a third of the training FLOPs per sample).
    expected = {"samples_per_s": 10 / 1.5, "batches_per_s": 3 / 1.5,
                "tokens_per_s": 50 / 1.5, "mfu": 100.0 * (10 / 1.5) / 1000.0}
    validated = loop.validate()
    assert {name: validated[f"val_{name}"] for name in expected} == pytest.approx(expected)
    tested = loop.evaluate(batches([4, 4, 2]), prefix="test")
    assert {name: tested[f"test_{name}"] for name in expected} == pytest.approx(expected)
    predicted = loop.predict(batches([4, 4, 2]))
    assert predicted.shape == (10, 3)
    assert {name: loop.state.metrics[f"predict_{name}"] for name in expected} == pytest.approx(
        expected)


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H200", "bfloat16", 989.4e12), ("NVIDIA H200 NVL", "bfloat16", 835.5e12),
    ("NVIDIA H100 80GB HBM3", "float8", 1978.9e12), ("NVIDIA H100 PCIe", "bfloat16", 756.5e12),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156e12), ("NVIDIA A100-PCIE-40GB", "float16", 312e12),
    ("NVIDIA L4", "bfloat16", 121e12), ("NVIDIA L40S", "bfloat16", 362e12),
    ("NVIDIA A10G", "float32", 31.2e12), ("Tesla V100-SXM2-16GB", "float16", 125e12),
    ("Tesla V100-PCIE-32GB", "float16", 112e12), ("Tesla T4", "float16", 65e12),
    ("NVIDIA GeForce RTX 4090", "bfloat16", 165.2e12),
    ("NVIDIA GeForce RTX 3090", "float16", 71e12), ("AMD Instinct MI300X", "bfloat16", 1307.4e12),
    ("AMD Instinct MI250X", "float16", 383e12), ("AMD Instinct MI250", "bfloat16", 362.1e12),
    ("Tesla T4", "bfloat16", None), ("cpu", "float32", None)])
def test_peak_flops_of_common_devices_from_their_data_sheets(name: str, precision: str,
                                                            peak: float | None) -> None:
    assert throughput.peak_flops_of(name, precision) == peak


def test_mfu_from_the_device_name_and_the_precision_trained_in(clock: Clock, monkeypatch) -> None:
    from hookloop.callbacks import AMP

    monkeypatch.setattr(throughput, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    for callbacks, peak in (([], 67e12), ([AMP(torch.bfloat16)], 989.4e12)):
        monitor = ThroughputMonitor(every_n_steps=2, flops_per_sample=1000.0)
        metrics = make_loop(batches([4, 4]), [*callbacks, Work(clock, 1.0), monitor]).fit(1).metrics
        assert "mfu" in monitor.produces(make_loop(batches([4]), []))
        assert metrics["mfu"] == pytest.approx(1000.0 * (8 / 2.0) / peak)
    overridden = ThroughputMonitor(every_n_steps=2, flops_per_sample=1000.0, peak_flops=4000.0)
    metrics = make_loop(batches([4, 4]), [Work(clock, 1.0), overridden]).fit(1).metrics
    assert metrics["mfu"] == pytest.approx(1000.0 * (8 / 2.0) / 4000.0)
    chosen = ThroughputMonitor(every_n_steps=2, flops_per_sample=1000.0, precision="float8")
    metrics = make_loop(batches([4, 4]), [Work(clock, 1.0), chosen]).fit(1).metrics
    assert metrics["mfu"] == pytest.approx(1000.0 * (8 / 2.0) / 1978.9e12)


def test_an_unknown_device_is_named_in_one_warning_and_gets_no_mfu(clock: Clock) -> None:
    monitor = ThroughputMonitor(every_n_steps=1, flops_per_sample=1000.0)
    loop = make_loop(batches([4, 4]), [Work(clock, 1.0), monitor])
    assert "mfu" not in monitor.produces(loop)
    with pytest.warns(RuntimeWarning, match=r"no peak FLOP/s known for the device 'cpu' in "
                                            r"float32.*Pass peak_flops=") as caught:
        metrics = loop.fit(2).metrics
    assert len([w for w in caught if "peak FLOP/s" in str(w.message)]) == 1
    assert "mfu" not in metrics and metrics["samples_per_s"] == pytest.approx(4.0)
    with pytest.raises(ConfigurationError, match="ThroughputMonitor precision must be"):
        ThroughputMonitor(precision="int4")
