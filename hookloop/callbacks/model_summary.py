"""A torchinfo summary of the model, once per fit, that changes nothing of the run."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hookloop.callback import Callback
from hookloop.checks import check_flag, check_int
from hookloop.errors import ConfigurationError
from hookloop.forward import model_inputs
from hookloop.untouched import untouched

if TYPE_CHECKING:
    from torchinfo.model_statistics import ModelStatistics

    from hookloop.loop import Loop

__all__ = ["ModelSummary"]


def _check_input_size(input_size: Any) -> list[Any]:
    """A shape (``[1, 3, 32, 32]``) or a list of shapes, every size a positive int."""
    def is_shape(value: Any) -> bool:
        return isinstance(value, (list, tuple, torch.Size)) and len(value) > 0 and all(
            isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in value)

    if is_shape(input_size) or (isinstance(input_size, (list, tuple)) and input_size
                                and all(is_shape(shape) for shape in input_size)):
        return list(input_size)
    raise ConfigurationError(
        f"ModelSummary input_size must be a shape such as (1, 3, 32, 32), a list of shapes "
        f"for a model with several inputs, or None (the shape of the first batch), got "
        f"{input_size!r}.")


class ModelSummary(Callback):
    """Print a ``torchinfo`` summary of the model (rank 0 only), once per fit.

    With ``input_size`` the summary runs at fit start on a random input of that size.
    Without it, the input is the first training batch (in ``on_batch_start``, already on
    the device), taken the way the loop would feed the model: the ``inputs`` of an
    ``(inputs, targets)`` pair, the keyword arguments of a mapping batch, or a lone
    tensor. Reading the batch from the loop means the data is never iterated an extra time
    (which would shift a shuffled loader's order).

    The probing forward runs in eval mode, without gradients, with the RNG streams forked;
    afterwards every module's train/eval mode and every buffer (BatchNorm running
    statistics) are restored, so the run is bitwise the same with or without the summary.
    If torchinfo fails (a model it cannot trace), a ``RuntimeWarning`` says why and
    training goes on.

    The result (``torchinfo.ModelStatistics``) is kept in ``self.summary``:
    ``summary.total_params``, ``summary.trainable_params``, ``summary.total_mult_adds``...

    Args:
        input_size: The input shape, batch dimension included, e.g. ``(32, 3, 224, 224)``
            (a list of shapes for several inputs); None takes the first batch.
        depth: How many levels of nested modules to show.
        print_summary: Print the table (with ``print``); False only keeps ``summary``.

    Raises:
        ConfigurationError: a depth that is not an int >= 0, an input size that is not a shape.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1))]
        >>> summary = ModelSummary(print_summary=False)
        >>> _ = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...          loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...          callbacks=[summary]).fit(1)
        hookloop: training ended at epoch 1/1, step 1: its 1 epoch is done.
        >>> summary.summary.total_params
        26
    """

    rank_zero_only = True

    def __init__(self, input_size: Sequence[int] | Sequence[Sequence[int]] | None = None, *,
                 depth: int = 3, print_summary: bool = True) -> None:
        self.input_size = None if input_size is None else _check_input_size(input_size)
        self.depth = check_int("ModelSummary depth", depth, minimum=0,
                               hint="It is how many levels of nested modules are shown.")
        self.print_summary = check_flag("ModelSummary print_summary", print_summary)
        #: The torchinfo result of the latest fit, or None before it (or when it failed).
        self.summary: ModelStatistics | None = None
        self._pending = False

    def __repr__(self) -> str:
        size = "" if self.input_size is None else f"input_size={tuple(self.input_size)}, "
        return f"ModelSummary({size}depth={self.depth})"

    def on_fit_start(self, loop: Loop) -> None:
        """With ``input_size``: summarize now; else at the first batch."""
        self.summary = None
        self._pending = self.input_size is None
        if not self._pending:
            self._summarize(loop, input_size=self.input_size)

    def on_batch_start(self, loop: Loop) -> None:
        """At the first batch of the fit, summarize with its inputs."""
        if not self._pending:
            return
        self._pending = False
        inputs = model_inputs(loop.state.batch)
        if inputs is None:
            warnings.warn(f"ModelSummary: cannot take the model's inputs from a batch of type "
                          f"{type(loop.state.batch).__name__}; pass ModelSummary(input_size=...). "
                          "No summary.", RuntimeWarning, stacklevel=2)
            return
        args, kwargs = inputs
        self._summarize(loop, input_data=kwargs if kwargs else list(args))

    def _summarize(self, loop: Loop, **inputs: Any) -> None:
        try:
            import torchinfo

            model = loop.unwrapped_model
            with untouched(model, tensors="buffers"), torch.no_grad():
                self.summary = torchinfo.summary(model, depth=self.depth, device=loop.device,
                                                 mode="eval", verbose=0, **inputs)
        except Exception as error:  # a summary never stops training
            warnings.warn(f"ModelSummary: torchinfo failed ({error!r}); training goes on "
                          "without a summary.", RuntimeWarning, stacklevel=3)
            return
        if self.print_summary:
            print(self.summary)
