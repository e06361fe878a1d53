"""What the logging views log, and when: shared by `TensorBoard` and the experiment trackers
(`WandbLogger`, `MLflowLogger`), so each shows the same values under the same tags at the
same steps.

* `step_values`: at every n-th optimizer step, the loss, learning rates, gradient norm and
  loss scale, kept as tensors on the device; `read_values` reads them in one go.
* `MetricSteps`: which entries of ``loop.state.metrics`` are due at a validation end and
  at an epoch end (each metric once per step, stale validation values left out).
* `gather_hparams`: the run's settings (never run state), for a hyper-parameter view.
"""

from __future__ import annotations

import enum
import functools
import inspect
import os
import re
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hookloop.base.compat import loss_scale
from hookloop.base.phase import Phase
from hookloop.callback import Callback

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["MetricSteps", "gather_hparams", "read_values", "step_due", "step_values"]

_Scalar = (int, float, str, bool)
_Hparam = int | float | str | bool
#: Argument names that say the value is a file (where the run writes), not a setting.
_FILE_ARGUMENT = re.compile(r"(^|_)(path|file|filename)$")


def _hparam(value: Any) -> _Hparam | None:
    """A setting as the HPARAMS tab shows it (a number, a string, a boolean), or None to
    leave it out (None itself, and values without a short meaningful form)."""
    if value is None:
        return None
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, _Scalar):
        return value
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else None
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (tuple, list, torch.Size)):
        items = [_hparam(item) for item in value]
        return repr(tuple(items)) if all(item is not None for item in items) else None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType,
                          types.MethodType, functools.partial)):
        function = value.func if isinstance(value, functools.partial) else value
        return getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
    if isinstance(value, Mapping):
        return None  # flattened by the caller
    return type(value).__name__  # an object (a built scheduler, a metric): its class


def _names_a_file(argument: str, value: Any) -> bool:
    """A path the run writes or reads as a file (``CSVLogger(path)``, ``resume="x.pt"``),
    which is not a setting; a directory given to a constructor is kept."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bool):
        return False
    path = os.fspath(value)
    if os.path.isdir(path):
        return False
    return os.path.isfile(path) or bool(_FILE_ARGUMENT.search(argument))


def _constructor_arguments(callback: Callback) -> dict[str, Any]:
    """The arguments of ``type(callback).__init__``, read back from the same-named
    attributes (how every built-in keeps them); ``name`` (the key) and ``*args`` and
    ``**kwargs`` are left out."""
    try:
        parameters = inspect.signature(type(callback).__init__).parameters
    except (TypeError, ValueError):
        return {}
    found: dict[str, Any] = {}
    for argument, parameter in list(parameters.items())[1:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) \
                or argument == "name" or not hasattr(callback, argument):
            continue
        found[argument] = getattr(callback, argument)
    return found


def gather_hparams(loop: Loop) -> dict[str, _Hparam]:
    """The run's hyper-parameters, for TensorBoard's HPARAMS tab: settings only, no run state.

    * ``optimizer`` (its class) and each param group's settings: ``optimizer/lr``,
      ``optimizer/momentum``..., or ``optimizer/group1/lr`` with several groups; ``lr`` is
      the configured rate (``initial_lr`` once a scheduler has moved it), a tuple setting
      gives one entry per item (``optimizer/betas_0``, ``optimizer/betas_1``).
    * ``batch_size`` (when ``train_data`` has one), ``epochs``, ``max_steps`` (when
      set) and ``accumulation_steps``.
    * each callback's constructor arguments under its name (``state_key``):
      ``GradClip/max_norm``, ``EarlyStopping/patience``, ``Checkpoint/dirpath``; a second
      callback of the same name gets ``#2``. Arguments left at None are left out, a mapping
      gives one entry per key (``AMP/scaler/init_scale``), a dtype, function or class its
      name, another object its class name. File paths are left out (``CSVLogger/path``, a
      ``resume`` file): they say where the run writes, not how it trains; a directory is
      kept.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> from hookloop.callbacks import GradClip
        >>> model = torch.nn.Linear(2, 1)
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [],
        ...             callbacks=[GradClip(1.0)])
        >>> params = gather_hparams(loop)
        >>> params["optimizer"], params["optimizer/lr"], params["GradClip/max_norm"]
        ('SGD', 0.1, 1.0)
    """
    params: dict[str, _Hparam] = {}

    def put(key: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for inner, item in value.items():
                put(f"{key}/{inner}", item)
            return
        converted = _hparam(value)
        if converted is not None:
            params[key] = converted

    optimizer = loop.optimizer
    params["optimizer"] = type(optimizer).__name__
    groups = optimizer.param_groups
    for index, group in enumerate(groups):
        prefix = "optimizer" if len(groups) == 1 else f"optimizer/group{index}"
        for key, value in group.items():
            if key in ("params", "initial_lr", "name"):
                continue
            if key == "lr":  # the configured rate, not where a scheduler has moved it
                value = group.get("initial_lr", value)
            if isinstance(value, (tuple, list)) and all(
                    isinstance(item, (int, float)) for item in value):
                for position, item in enumerate(value):
                    params[f"{prefix}/{key}_{position}"] = item
            elif isinstance(value, (*_Scalar, torch.Tensor)):
                put(f"{prefix}/{key}", value)
    batch_size = getattr(loop.train_data, "batch_size", None)
    if isinstance(batch_size, int):
        params["batch_size"] = batch_size
    if loop.state.epochs:
        params["epochs"] = loop.state.epochs
    if loop.state.max_steps is not None:
        params["max_steps"] = loop.state.max_steps
    params["accumulation_steps"] = loop.accumulation_steps
    seen: dict[str, int] = {}
    for callback in loop.callbacks:
        key = callback.state_key
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            key = f"{key}#{seen[key]}"
        for argument, value in _constructor_arguments(callback).items():
            if not _names_a_file(argument, value):
                put(f"{key}/{argument}", value)
    return params



def step_due(loop: Loop, every_n_steps: int) -> bool:
    """At ``after_step``: is this optimizer step one the views log (every n-th, with a loss)?"""
    state = loop.state
    return state.step % every_n_steps == 0 and state.loss is not None


def step_values(loop: Loop) -> dict[str, torch.Tensor | float]:
    """The ``step/*`` values of this optimizer step, by tag, without a host read.

    ``step/loss`` (the true loss of the batch that completed the step), ``step/grad_norm``
    when `GradClip` ran, ``step/loss_scale`` when `AMP` uses a GradScaler (tensors, on the
    device), and ``step/lr`` (``step/lr_group{i}`` with several param groups; floats).

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(2, 1)
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [])
        >>> loop.state.loss = torch.tensor(0.5)
        >>> read_values(step_values(loop))
        {'step/loss': 0.5, 'step/lr': 0.1}
    """
    state = loop.state
    values: dict[str, torch.Tensor | float] = {}
    if state.loss is not None:
        values["step/loss"] = state.loss.detach()
    if state.grad_norm is not None:
        values["step/grad_norm"] = state.grad_norm.detach()
    scale = None if loop.scaler is None else loss_scale(loop.scaler)
    if scale is not None:
        values["step/loss_scale"] = scale
    groups = loop.optimizer.param_groups
    for index, group in enumerate(groups):
        values["step/lr" if len(groups) == 1 else f"step/lr_group{index}"] = float(group["lr"])
    return values


def read_values(values: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """``values`` as floats: every tensor among them read from the device at once."""
    tensors = [(tag, value) for tag, value in values.items() if isinstance(value, torch.Tensor)]
    read: dict[str, float] = {}
    if tensors:
        device = tensors[0][1].device
        numbers = torch.stack([value.float().reshape(()).to(device)
                               for _, value in tensors]).tolist()
        read = dict(zip((tag for tag, _ in tensors), numbers))
    return {tag: read[tag] if tag in read else float(value) for tag, value in values.items()}


class MetricSteps:
    """Which metrics of ``loop.state.metrics`` a view logs, as ``metrics/<name>``, and when.

    * `at_validation_end`: every metric, at the current step, after a validation of the
      fit (not the sanity check, not ``evaluate``).
    * `at_epoch_end`: those not logged at this step yet (``train_loss`` without validation
      data, metrics written after validation). Validation metrics (``val_*``) appear once
      per validation, at its step: an epoch end that did not validate leaves them out. An
      epoch that the end of a launch cut short logs nothing: the relaunch finishes the
      epoch and logs its metrics at its end, as the uninterrupted run does.

    Only numbers are logged (a one-element tensor is read); booleans and other values are
    left out.

    Example:
        >>> steps = MetricSteps()
        >>> steps.reset()
    """

    __slots__ = ("_logged_at", "_validated_step")

    def __init__(self) -> None:
        self._logged_at: dict[str, int] = {}
        self._validated_step = -1

    def reset(self) -> None:
        """At fit start: nothing logged in this fit yet."""
        self._logged_at, self._validated_step = {}, -1

    def at_validation_end(self, loop: Loop) -> dict[str, float]:
        """``{tag: value}`` due at this ``on_validation_end`` (empty outside fit's validations)."""
        if loop.phase is not Phase.VALIDATE:
            return {}
        self._validated_step = loop.state.step
        return self._due(loop, only_new=False, stale_val=False)

    def at_epoch_end(self, loop: Loop) -> dict[str, float]:
        """``{tag: value}`` due at this ``on_epoch_end``."""
        if loop.stop_resumable and not loop.epoch_completed:
            return {}
        return self._due(loop, only_new=True,
                         stale_val=self._validated_step != loop.state.step)

    def _due(self, loop: Loop, *, only_new: bool, stale_val: bool) -> dict[str, float]:
        step, due = loop.state.step, {}
        for name, value in loop.state.metrics.items():
            if only_new and self._logged_at.get(name) == step:
                continue
            if stale_val and name.startswith(("val_", "ema_val_")):
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._logged_at[name] = step
            due[f"metrics/{name}"] = float(value)
        return due
