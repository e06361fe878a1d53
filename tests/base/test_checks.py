"""One message form for a bad argument, over every constructor that checks its arguments:

    <Owner> <argument> must be <requirement>, got <repr(value)>.[ <advice>]

Each case builds one object with one bad value and compares the whole message with the
form: the owner and argument as the user wrote them, the value exactly as ``repr`` shows
it. (The validators themselves are in hookloop/base/checks.py, with doctests.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hookloop import ConfigurationError, Loop, lr_find
from hookloop.callbacks import (
    AMP,
    DDP,
    EMA,
    CSVLogger,
    EarlyStopping,
    GradAccumulation,
    GradClip,
    LRScheduler,
    Metrics,
    ModelSummary,
    Profiler,
    ProgressBar,
    TensorBoard,
    TerminateOnNaN,
)
from hookloop.callbacks.ddp import UnpaddedDistributedSampler
from hookloop.monitor import Monitor
from hookloop.schedules import resolve_warmup, warmup_cosine, warmup_linear


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


def _lr_find(**arguments: Any) -> Any:
    model = torch.nn.Linear(2, 1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                [(torch.randn(4, 2), torch.randn(4, 1))], loss_fn=torch.nn.functional.mse_loss,
                device="cpu")
    return lr_find(loop, **arguments)


class Shown:
    """What a message shows where no single value is wrong (a relation, nothing given)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


F16 = torch.float16
#: (label in the message, the bad value, how to build with it).
CASES: list[tuple[str, Any, Callable[[Any], Any]]] = [
    ("AMP dtype", "fp32", lambda v: AMP(v)),
    ("AMP scaler", "yes", lambda v: AMP(F16, scaler=v)),
    ("AMP scaler init_scale", 0, lambda v: AMP(F16, scaler={"init_scale": v})),
    ("AMP scaler init_scale", math.inf, lambda v: AMP(F16, scaler={"init_scale": v})),
    ("AMP scaler growth_factor", 1.0, lambda v: AMP(F16, scaler={"growth_factor": v})),
    ("AMP scaler backoff_factor", 1.5, lambda v: AMP(F16, scaler={"backoff_factor": v})),
    ("AMP scaler growth_interval", 0, lambda v: AMP(F16, scaler={"growth_interval": v})),
    ("AMP scaler enabled", "yes", lambda v: AMP(F16, scaler={"enabled": v})),
    ("AMP name", "", lambda v: AMP(name=v)),
    ("EMA decay", 1.5, lambda v: EMA(v)),
    ("EMA decay", True, lambda v: EMA(v)),
    ("EMA every_n_steps", 0, lambda v: EMA(every_n_steps=v)),
    ("EMA validate_with_ema", "yes", lambda v: EMA(validate_with_ema=v)),
    ("EMA buffers", "avg", lambda v: EMA(buffers=v)),
    ("EMA warmup", None, lambda v: EMA(warmup=v)),
    ("EMA start_step", -1, lambda v: EMA(start_step=v)),
    ("EMA name", 3, lambda v: EMA(name=v)),
    ("GradAccumulation steps", 0, lambda v: GradAccumulation(v)),
    ("GradAccumulation steps", 2.0, lambda v: GradAccumulation(v)),
    ("GradClip max_norm", -1.0, lambda v: GradClip(v)),
    ("GradClip max_value", 0, lambda v: GradClip(max_value=v)),
    ("GradClip norm_type", "fro", lambda v: GradClip(1.0, norm_type=v)),
    ("GradClip max_norm and max_value", Shown("max_norm=None, max_value=None"),
     lambda v: GradClip()),
    ("LRScheduler scheduler", 42, lambda v: LRScheduler(v)),
    ("LRScheduler interval", "batch", lambda v: LRScheduler(lambda o, t: None, interval=v)),
    ("LRScheduler monitor", 3, lambda v: LRScheduler(lambda o, t: None, monitor=v)),
    ("LRScheduler name", "", lambda v: LRScheduler(lambda o, t: None, name=v)),
    ("LRScheduler monitor", "val_loss", lambda v: LRScheduler(
        torch.optim.lr_scheduler.StepLR(_optimizer(), 1), monitor=v)),
    ("LRScheduler monitor", None, lambda v: LRScheduler(
        torch.optim.lr_scheduler.ReduceLROnPlateau(_optimizer()), monitor=v)),
    ("EarlyStopping monitor", "", lambda v: EarlyStopping(v)),
    ("EarlyStopping mode", "up", lambda v: EarlyStopping(mode=v)),
    ("EarlyStopping patience", 0, lambda v: EarlyStopping(patience=v)),
    ("EarlyStopping min_delta", -1.0, lambda v: EarlyStopping(min_delta=v)),
    ("EarlyStopping baseline", "0.5", lambda v: EarlyStopping(baseline=v)),
    ("EarlyStopping start_from_epoch", -1, lambda v: EarlyStopping(start_from_epoch=v)),
    ("EarlyStopping stopping_threshold", math.inf, lambda v: EarlyStopping(stopping_threshold=v)),
    ("EarlyStopping divergence_threshold", math.nan,
     lambda v: EarlyStopping(divergence_threshold=v)),
    ("EarlyStopping check_finite", 1, lambda v: EarlyStopping(check_finite=v)),
    ("EarlyStopping restore_best_weights", None, lambda v: EarlyStopping(restore_best_weights=v)),
    ("EarlyStopping name", "", lambda v: EarlyStopping(name=v)),
    ("Monitor mode", "maximum", lambda v: Monitor("val_acc", v, owner="Monitor")),
    ("Metrics metrics", Shown("none"), lambda v: Metrics()),
    ("Metrics on_train", "yes", lambda v: Metrics(acc=_accuracy, on_train=v)),
    ("Metrics name", 3, lambda v: Metrics(acc=_accuracy, name=v)),
    ("Metrics targets", "label", lambda v: Metrics(acc=_accuracy, targets=v)),
    ("Metrics outputs", 1, lambda v: Metrics(acc=_accuracy, outputs=v)),
    ("Metrics acc", 3, lambda v: Metrics(acc=v)),
    ("TerminateOnNaN check_gradients", "yes", lambda v: TerminateOnNaN(check_gradients=v)),
    ("TerminateOnNaN restore_buffers", 1, lambda v: TerminateOnNaN(restore_buffers=v)),
    ("TerminateOnNaN raise_error", None, lambda v: TerminateOnNaN(raise_error=v)),
    ("TensorBoard log_dir", 3, lambda v: TensorBoard(v)),
    ("TensorBoard every_n_steps", 0, lambda v: TensorBoard(every_n_steps=v)),
    ("TensorBoard histograms_every_n_epochs", 0,
     lambda v: TensorBoard(histograms_every_n_epochs=v)),
    ("TensorBoard graph", 1, lambda v: TensorBoard(graph=v)),
    ("TensorBoard hparams", "lr=0.1", lambda v: TensorBoard(hparams=v)),
    ("TensorBoard flush_secs", 0, lambda v: TensorBoard(flush_secs=v)),
    ("ProgressBar refresh_per_second", 0, lambda v: ProgressBar(refresh_per_second=v)),
    ("ProgressBar plain_every_s", -1.0, lambda v: ProgressBar(plain_every_s=v)),
    ("ProgressBar terminal", "yes", lambda v: ProgressBar(terminal=v)),
    ("ModelSummary input_size", "1x3", lambda v: ModelSummary(v)),
    ("ModelSummary depth", -1, lambda v: ModelSummary(depth=v)),
    ("ModelSummary print_summary", None, lambda v: ModelSummary(print_summary=v)),
    ("CSVLogger path", 3, lambda v: CSVLogger(v)),
    ("CSVLogger every_n_steps", 0, lambda v: CSVLogger("log.csv", every_n_steps=v)),
    ("Profiler sync_cuda", "no", lambda v: Profiler(sync_cuda=v)),
    ("Profiler print_table", None, lambda v: Profiler(print_table=v)),
    ("DDP backend", 123, lambda v: DDP(backend=v)),
    ("DDP find_unused_parameters", "no", lambda v: DDP(find_unused_parameters=v)),
    ("UnpaddedDistributedSampler rank", 2,
     lambda v: UnpaddedDistributedSampler(range(4), num_replicas=2, rank=v)),
    ("UnpaddedDistributedSampler rank", -1,
     lambda v: UnpaddedDistributedSampler(range(4), num_replicas=2, rank=v)),
    ("lr_find start_lr", 0, lambda v: _lr_find(start_lr=v)),
    ("lr_find end_lr", 1e-8, lambda v: _lr_find(end_lr=v)),  # below start_lr
    ("lr_find steps", 1, lambda v: _lr_find(steps=v)),
    ("lr_find smoothing", 1.0, lambda v: _lr_find(smoothing=v)),
    ("lr_find divergence", 1.0, lambda v: _lr_find(divergence=v)),
    ("warmup_cosine total_steps", 0, lambda v: warmup_cosine(_optimizer(), v, 0)),
    ("warmup_cosine min_lr", -1.0, lambda v: warmup_cosine(_optimizer(), 10, 0, min_lr=v)),
    ("warmup_cosine warmup_steps", 1.5, lambda v: warmup_cosine(_optimizer(), 10, v)),
    ("warmup_linear warmup_steps", 11, lambda v: warmup_linear(_optimizer(), 10, v)),
    ("warmup_linear warmup_steps", -1, lambda v: warmup_linear(_optimizer(), 10, v)),
    ("warmup_steps", "5", lambda v: resolve_warmup(10, v)),
]


@pytest.mark.parametrize(("label", "value", "build"), CASES,
                         ids=[f"{label}={value!r}" for label, value, _ in CASES])
def test_one_message_form(label: str, value: Any, build: Callable[[Any], Any]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        build(value)
    message = str(caught.value)
    form = (rf"{re.escape(label)} must be (?P<requirement>.+?), got "
            rf"{re.escape(repr(value))}\.(?P<advice> .+)?")
    assert re.fullmatch(form, message, flags=re.DOTALL), message


@pytest.mark.parametrize(("build", "advice"), [
    (lambda: EMA(decay=1.0), "would never move the average"),
    (lambda: EarlyStopping(patience=0), "validations without improvement"),
    (lambda: GradAccumulation(0), "1 means no accumulation"),
    (lambda: CSVLogger("log.csv", every_n_steps=0), "None writes history rows only"),
    (lambda: EarlyStopping(min_delta=-1.0), "the direction comes from mode"),
    (lambda: DDP(backend=""), "None picks nccl on CUDA, gloo on CPU"),
    (lambda: AMP(F16, scaler={"growth_interval": 0}), "2000"),
])
def test_the_advice_of_the_old_messages_is_kept(build: Callable[[], Any], advice: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(advice)):
        build()
