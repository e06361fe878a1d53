"""`loop.scaler`: AMP publishes its GradScaler there, and TerminateOnNaN and TensorBoard read
it there (not from any callback that happens to have a ``scaler`` attribute).

Oracles: the GradScaler object AMP holds, torch's own scaler arithmetic (a skipped step
halves the scale), and the event files read back with tensorboard's EventAccumulator.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hookloop import Callback, Loop
from hookloop.callbacks import AMP, TensorBoard, TerminateOnNaN

BATCHES = 6


def make_loop(callbacks: list[Callback]) -> Loop:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 5, generator=generator), torch.randint(0, 3, (4,), generator=generator))
            for _ in range(BATCHES)]
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=F.cross_entropy, callbacks=callbacks, device="cpu")


class SeesScaler(Callback):
    """Records what ``loop.scaler`` is at fit start and at every step."""

    def __init__(self) -> None:
        self.at_fit_start: object = "unset"
        self.at_steps: list[object] = []

    def on_fit_start(self, loop: Loop) -> None:
        self.at_fit_start = loop.scaler

    def after_step(self, loop: Loop) -> None:
        self.at_steps.append(loop.scaler)


class Decoy(Callback):
    """Not AMP, but with an enabled GradScaler under the attribute name ``scaler``."""

    def __init__(self) -> None:
        self.scaler = torch.amp.GradScaler("cpu", init_scale=512.0)


class OwnScaler(Callback):
    """A user callback that publishes its own (unused for stepping) scaler in ``setup``."""

    def __init__(self, scale: float) -> None:
        self.own = torch.amp.GradScaler("cpu", init_scale=scale)

    def setup(self, loop: Loop) -> None:
        self.own.scale(torch.ones(()))  # a GradScaler makes its scale tensor at first use
        loop.scaler = self.own


class InfGradients(Callback):
    """Makes the gradients of the first weight infinite on one batch (the loss stays finite)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.handle: torch.utils.hooks.RemovableHandle | None = None

    def on_batch_start(self, loop: Loop) -> None:
        if loop.state.batch_idx == self.batch and self.handle is None:
            weight = loop.unwrapped_model[0].weight
            self.handle = weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))

    def on_batch_end(self, loop: Loop) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def test_amp_float16_sets_loop_scaler_to_its_grad_scaler() -> None:
    amp, seen = AMP(torch.float16, scaler={"init_scale": 1024.0}), SeesScaler()
    loop = make_loop([amp, seen])
    assert loop.scaler is None  # nothing before the first setup
    loop.fit(1)
    assert isinstance(amp.scaler, torch.amp.GradScaler)
    assert seen.at_fit_start is amp.scaler and all(s is amp.scaler for s in seen.at_steps)
    assert len(seen.at_steps) == BATCHES
    loop.fit(2)  # the same scaler continues across fits (its scale is the run's)
    assert seen.at_fit_start is amp.scaler


def test_no_scaler_means_loop_scaler_is_none() -> None:
    for amp in (AMP(torch.bfloat16), AMP(torch.float16, scaler=False),
                AMP(torch.float16, scaler={"enabled": False})):
        seen = SeesScaler()
        make_loop([amp, seen]).fit(1)
        assert seen.at_fit_start is None, amp
    seen = SeesScaler()
    make_loop([Decoy(), seen]).fit(1)
    assert seen.at_fit_start is None  # a `scaler` attribute on a callback is not the scaler


def test_loop_scaler_is_reset_at_every_setup() -> None:
    seen = SeesScaler()
    loop = make_loop([seen])
    loop.scaler = torch.amp.GradScaler("cpu")  # left over from somewhere: not this fit's
    loop.fit(1)
    assert seen.at_fit_start is None and loop.scaler is None


def test_terminate_on_nan_leaves_inf_gradients_to_the_scaler_of_loop_scaler() -> None:
    # Under float16 AMP the inf gradients of batch 2 are an overflow: the scaler skips that
    # step and halves the scale, and training goes on.
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    loop = make_loop([InfGradients(batch=2), amp, TerminateOnNaN()])
    loop.fit(1)
    assert loop.stop_reason is None
    assert amp.skipped_steps == 1 and loop.state.step == BATCHES - 1
    assert amp.scaler.get_scale() == 512.0  # torch's backoff_factor 0.5, once


def test_terminate_on_nan_checks_gradients_when_no_loop_scaler() -> None:
    # Without a scaler a non-finite gradient is a fault, even if some callback has an
    # attribute named `scaler`: TerminateOnNaN reads loop.scaler, not the callbacks.
    for stack in ([InfGradients(batch=2), TerminateOnNaN()],
                  [InfGradients(batch=2), Decoy(), TerminateOnNaN()],
                  [InfGradients(batch=2), AMP(torch.bfloat16), TerminateOnNaN()]):
        loop = make_loop(stack)
        loop.fit(1)
        assert loop.stop_reason is not None and "non-finite gradients" in loop.stop_reason
        assert loop.state.step == 2  # batches 0 and 1 stepped, batch 2 was skipped


def scales(log_dir: Path) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    if "step/loss_scale" not in accumulator.Tags()["scalars"]:
        return []
    return [(event.step, event.value) for event in accumulator.Scalars("step/loss_scale")]


def test_tensorboard_logs_the_scale_of_loop_scaler(tmp_path: Path) -> None:
    amp = AMP(torch.float16, scaler={"init_scale": 256.0})
    loop = make_loop([InfGradients(batch=2), amp, TensorBoard(tmp_path / "amp", every_n_steps=1)])
    loop.fit(1)
    # Steps 1 and 2 at 256; batch 2 skipped (scale halved to 128); the rest at 128.
    assert scales(tmp_path / "amp") == [(1, 256.0), (2, 256.0), (3, 128.0), (4, 128.0),
                                        (5, 128.0)]
    assert amp.scaler.get_scale() == 128.0

    make_loop([OwnScaler(64.0), TensorBoard(tmp_path / "own", every_n_steps=2)]).fit(1)
    assert scales(tmp_path / "own") == [(2, 64.0), (4, 64.0), (6, 64.0)]

    make_loop([Decoy(), TensorBoard(tmp_path / "decoy", every_n_steps=1)]).fit(1)
    assert scales(tmp_path / "decoy") == []
