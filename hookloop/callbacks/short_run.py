"""End a fit after a fixed number of optimizer steps: a quick check that a stack runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookloop.base.checks import check_int
from hookloop.callback import Callback

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["ShortRun"]


class ShortRun(Callback):
    """End the fit after ``steps`` optimizer steps in all: a quick check that a stack runs.

    Calls ``loop.stop()`` once ``loop.state.step`` reaches ``steps``; the fit ends at that
    step boundary and ``on_epoch_end``/``on_fit_end`` still fire. The epoch it cuts short
    runs no validation: call ``loop.validate()`` afterwards to try the validation path.
    ``loop.fit(epochs, max_steps=N)`` does the same from the call site; this callback does
    it from inside a preset.

    Args:
        steps: Optimizer steps after which training ends.

    Raises:
        ConfigurationError: ``steps`` is not an int >= 1.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(10)]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[ShortRun(steps=4)])
        >>> loop.fit(3).step
        hookloop: training ended at epoch 1/3, step 4: ShortRun: 4 optimizer steps done.
        4
    """

    def __init__(self, steps: int = 20) -> None:
        self.steps = check_int("ShortRun steps", steps)

    def __repr__(self) -> str:
        return f"ShortRun(steps={self.steps})"

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step >= self.steps and not loop.stop_requested:
            loop.stop(f"ShortRun: {self.steps} optimizer steps done")
