"""A torchinfo summary of the model, once per fit, that changes nothing of the run."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hookloop.base.checks import check_console, check_flag, check_int
from hookloop.callback import Callback
from hookloop.engine.forward import ForwardRule
from hookloop.engine.untouched import untouched
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from rich.console import Console
    from torchinfo.model_statistics import ModelStatistics

    from hookloop.loop import Loop

__all__ = ["ModelSummary"]

_HOW = ("Pass ModelSummary(input_size=(batch, ...)) (presets.debug(input_size=...)) to "
        "summarize from a random input of that shape instead.")


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


def fitted_text(summary: ModelStatistics, width: int) -> str:
    """torchinfo's table narrowed to ``width`` columns when it is wider (its default is 90).

    torchinfo pads the layer names to 40 characters and every other column to 25, and draws
    its rules that wide; a terminal of 80 columns wrapped every rule and row. The columns
    are narrowed to what their longest cell needs (plus two spaces), and the room left is
    shared out again up to torchinfo's widths. A table whose cells cannot fit stays at
    that narrowest.
    """
    formatting = summary.formatting
    text = str(summary)
    if max(map(len, text.splitlines())) <= width:
        return text
    names, columns = formatting.layer_name_width, formatting.col_width
    count = len(tuple(formatting.col_names))
    rules = [index for index, line in enumerate(text.splitlines()) if set(line) == {"="}]
    rows = text.splitlines()[rules[0] + 1:rules[2]] if len(rules) >= 3 else []
    rows = [row for row in rows if set(row) != {"="}]
    longest_name = max((len(row[:names].rstrip()) for row in rows), default=names - 2)
    longest_cell = max((len(row[names + 1 + i * (columns + 1):names + 1 + (i + 1) * (columns + 1)]
                            .rstrip()) for row in rows for i in range(count)), default=columns - 2)
    name_width, cell_width = longest_name + 2, longest_cell + 2
    spare = width - name_width - cell_width * count
    if spare > 0:  # the room left, to the value columns first, up to torchinfo's widths
        cell_width = min(columns, cell_width + spare // max(count, 1))
        name_width = min(names, width - cell_width * count)
    try:
        formatting.layer_name_width, formatting.col_width = name_width, cell_width
        return str(summary)
    finally:
        formatting.layer_name_width, formatting.col_width = names, columns


class _Captured(Exception):
    """Raised by the probe's hook at the model's first call: its inputs are known."""


class _Probe:
    """The loop as the probing forward sees it: everything of the loop, but ``model`` is the
    unwrapped module (a DDP wrapper would sync buffers, a collective on rank 0 alone; a
    compiled one would compile again)."""

    def __init__(self, loop: Loop) -> None:
        self._real = loop
        self.model = loop.unwrapped_model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _describe(value: Any) -> str:
    """A short text of an input: ``Tensor[4, 5]``, ``dict(image=Tensor[4, 3])``..."""
    if isinstance(value, torch.Tensor):
        return f"Tensor[{', '.join(map(str, value.shape))}]"
    if isinstance(value, Mapping):
        return "dict(" + ", ".join(f"{key}={_describe(item)}" for key, item in value.items()) + ")"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ", ".join(_describe(item) for item in value) + ")"
    return type(value).__name__


def _call_text(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    parts = [_describe(arg) for arg in args] + [f"{key}={_describe(value)}"
                                                 for key, value in kwargs.items()]
    return f"model({', '.join(parts)})"


def _model_call(loop: Loop, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments the loop's own forward gives the model for ``batch``.

    Runs the loss rules (``forward=``, a pair with ``loss_fn``, a mapping...) as a training
    batch would, with the unwrapped model, up to the model's first call, which is stopped
    there: the model itself does not run, and neither does the rest of the forward. Without
    gradients, inside `untouched` (random streams, modes and buffers are put back).

    Raises:
        ConfigurationError: the forward raised before calling the model, or returned
            without calling it (it may call a submodule or another model); the message
            says so and that ``ModelSummary(input_size=...)`` works without a batch.
    """
    probe = _Probe(loop)
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def stop(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.append((args, dict(kwargs)))
        raise _Captured

    handle = probe.model.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with untouched(probe.model, tensors="buffers"), torch.no_grad():
            ForwardRule(probe, loop.forward, loop.loss_fn, loop.inputs,
                        loop.targets).compute(probe.model, batch)
    except _Captured:
        pass
    except Exception as error:
        cause = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ConfigurationError(
            f"the loop's forward raised {type(error).__name__}: {cause} before it called the "
            "model, so the model's inputs are unknown") from error
    finally:
        handle.remove()
    if not captured:
        raise ConfigurationError(
            "the loop's forward returned without calling loop.model (it may call a submodule "
            "or another model), so the model's inputs are unknown")
    return captured[0]


class ModelSummary(Callback):
    """Print a ``torchinfo`` summary of the model (rank 0 only), once per fit.

    With ``input_size`` the summary runs at fit start on a random input of that size.
    Without it, the input is what the loop's own forward gives the model for the first
    training batch (in ``on_batch_start``, already on the device): the loss rules run as
    for training (``forward=``, the ``inputs`` of an ``(inputs, targets)`` pair, the
    keyword arguments of a mapping batch) up to the model's first call, which is stopped
    there and recorded; torchinfo then runs the model on exactly those arguments. So a
    ``forward=`` that picks ``batch["image"]`` out of a dict, or adds a mask, is summarized
    as it trains. The probe uses the unwrapped model (no DDP collective, no recompilation).
    Reading the batch from the loop means the data is never iterated an extra time
    (which would shift a shuffled loader's order).

    When that cannot work (the forward raises before calling the model, or calls a
    submodule instead of ``loop.model``, or torchinfo cannot run the model), a
    ``RuntimeWarning`` says which, with the call it tried (``model(Tensor[4, 5])``) and
    the cause, and that ``input_size=`` summarizes without a batch; training goes on.

    The probing forward runs in eval mode, without gradients, with the RNG streams forked;
    afterwards every module's train/eval mode and every buffer (BatchNorm running
    statistics) are restored, so the run is bitwise the same with or without the summary
    (also the random numbers a ``forward=`` draws before calling the model).

    The result (``torchinfo.ModelStatistics``) is kept in ``self.summary``:
    ``summary.total_params``, ``summary.trainable_params``, ``summary.total_mult_adds``...

    Args:
        input_size: The input shape, batch dimension included, e.g. ``(32, 3, 224, 224)``
            (a list of shapes for several inputs); None takes the first batch.
        depth: How many levels of nested modules to show.
        print_summary: Print the table; False only keeps ``summary``.
        console: The ``rich.console.Console`` to print on (its width); None prints on
            stdout, as wide as the terminal. A table wider than that (torchinfo's is 90
            columns) is narrowed to fit, so its rules and rows never wrap.

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
                 depth: int = 3, print_summary: bool = True,
                 console: Console | None = None) -> None:
        self.input_size = None if input_size is None else _check_input_size(input_size)
        self.depth = check_int("ModelSummary depth", depth, minimum=0,
                               hint="It is how many levels of nested modules are shown.")
        self.print_summary = check_flag("ModelSummary print_summary", print_summary)
        self.console = check_console("ModelSummary", console)
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
            self._summarize(loop, f"a random input of size {tuple(self.input_size or ())}",
                            input_size=self.input_size)

    def on_batch_start(self, loop: Loop) -> None:
        """At the first batch of the fit, summarize with the inputs the loop gives the model."""
        if not self._pending:
            return
        self._pending = False
        try:
            args, kwargs = _model_call(loop, loop.state.batch)
        except ConfigurationError as error:
            warnings.warn(f"ModelSummary: no summary: {error}. {_HOW}", RuntimeWarning,
                          stacklevel=2)
            return
        if kwargs and not args:
            self._summarize(loop, _call_text(args, kwargs), input_data=kwargs)
        else:
            self._summarize(loop, _call_text(args, kwargs), input_data=list(args), **kwargs)

    def _summarize(self, loop: Loop, call: str, **inputs: Any) -> None:
        try:
            import torchinfo

            model = loop.unwrapped_model
            with untouched(model, tensors="buffers"), torch.no_grad():
                self.summary = torchinfo.summary(model, depth=self.depth, device=loop.device,
                                                 mode="eval", verbose=0, **inputs)
        except Exception as error:  # noqa: BLE001 - a summary never stops training
            cause = error.__cause__ or error  # torchinfo wraps the model's own error
            text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            how = ("Check input_size: it is the shape of one input, batch included."
                   if self.input_size is not None else _HOW)
            warnings.warn(f"ModelSummary: torchinfo failed on {call}: "
                          f"{type(cause).__name__}: {text}. Training goes on without a summary. "
                          f"{how}", RuntimeWarning, stacklevel=3)
            return
        if not self.print_summary:
            return
        if self.console is not None:
            self.console.print(fitted_text(self.summary, self.console.width), markup=False,
                               highlight=False, soft_wrap=True)
        else:
            print(fitted_text(self.summary, shutil.get_terminal_size().columns))
