"""Autograd anomaly detection for the first optimizer steps of a run."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hookloop.base.checks import check_int
from hookloop.callback import Callback

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["DetectAnomaly"]


class DetectAnomaly(Callback):
    """Turn on autograd's anomaly detection for the first ``steps`` optimizer steps.

    While it is on, a backward pass that produces NaN raises at once, with the traceback
    of the forward operation that caused it (``torch.autograd.set_detect_anomaly``). It
    slows every step down a lot, which is why it is switched off after ``steps`` steps. The
    previous setting is restored at fit end, also after an exception.

    Args:
        steps: Optimizer steps (``loop.state.step``) to run with anomaly detection.

    Raises:
        ConfigurationError: ``steps`` is not an int >= 1.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[DetectAnomaly(steps=2)])
        >>> loop.fit(1).step, torch.is_anomaly_enabled()
        hookloop: training ended at epoch 1/1, step 3: its 1 epoch is done.
        (3, False)
    """

    def __init__(self, steps: int = 5) -> None:
        self.steps = check_int("DetectAnomaly steps", steps)
        self._previous: tuple[bool, bool] | None = None

    def __repr__(self) -> str:
        return f"DetectAnomaly(steps={self.steps})"

    def on_fit_start(self, loop: Loop) -> None:
        # A resumed run past its first steps does not pay for detection again.
        if loop.state.step < self.steps:
            self._previous = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.autograd.set_detect_anomaly(True, check_nan=True)

    def on_batch_end(self, loop: Loop) -> None:
        if self._previous is not None and loop.state.step >= self.steps:
            self._restore()

    def on_fit_end(self, loop: Loop) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            enabled, check_nan = self._previous
            torch.autograd.set_detect_anomaly(enabled, check_nan=check_nan)
            self._previous = None
