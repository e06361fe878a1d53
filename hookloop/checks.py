"""Argument checks: the generic ones every constructor uses, and the `Loop`'s own.

Each mistake found here would otherwise fail late (after an epoch), raw (a TypeError
from deep inside torch), or not at all (training nothing). Every error names the argument,
what is wrong with it and the fix, in one form::

    EarlyStopping patience must be an int >= 1, got 0.

The generic checks (`check_int`, `check_optional_int`, `check_flag`, `check_number`,
`check_name`, `check_choice`, `check_path`) take the label first (the owner and the
argument: ``"EarlyStopping patience"``) and return the value they accepted, so a
constructor reads ``self.patience = check_int("EarlyStopping patience", patience)``.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.data import find_targets, length_of
from hookloop.errors import ConfigurationError, with_article
from hookloop.forward import check_batch_rule
from hookloop.ordering import check_callbacks
from hookloop.untouched import untouched

__all__ = ["check_int", "check_optional_int", "check_flag", "check_number", "check_duration",
           "check_name",
           "check_choice", "check_path", "check_console", "check_loop_arguments",
           "check_fit", "check_fit_arguments", "check_fit_data", "check_evaluation", "check_setup", "resolve_device",
           "available_devices", "check_that"]


def _refuse(label: str, requirement: str, value: Any, hint: str = "") -> ConfigurationError:
    """The one message form: ``{label} must be {requirement}, got {value!r}. {hint}``."""
    return ConfigurationError(f"{label} must be {requirement}, got {value!r}."
                              + (f" {hint}" if hint else ""))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(label: str, value: Any, *, minimum: int = 1, hint: str = "") -> int:
    """``value`` if it is an int >= ``minimum`` (a bool is not an int here).

    Example:
        >>> check_int("EarlyStopping patience", 3)
        3
        >>> check_int("EarlyStopping patience", 0)
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: EarlyStopping patience must be an int >= 1, got 0.
    """
    if not _is_int(value) or value < minimum:
        raise _refuse(label, f"an int >= {minimum}", value, hint)
    return value


def check_optional_int(label: str, value: Any, *, minimum: int = 1, hint: str = "") -> int | None:
    """``value`` if it is None or an int >= ``minimum``.

    Example:
        >>> check_optional_int("Checkpoint keep_last", None) is None
        True
        >>> check_optional_int("Checkpoint keep_last", 0)
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: Checkpoint keep_last must be an int >= 1 or None, got 0.
    """
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise _refuse(label, f"an int >= {minimum} or None", value, hint)
    return value


def check_flag(label: str, value: Any, *, hint: str = "") -> bool:
    """``value`` if it is True or False (not 0, 1 or None).

    Example:
        >>> check_flag("TensorBoard graph", True)
        True
    """
    if not isinstance(value, bool):
        raise _refuse(label, "True or False", value, hint)
    return value


def check_number(label: str, value: Any, *, minimum: float | None = None,
                 above: float | None = None, below: float | None = None,
                 maximum: float | None = None, optional: bool = False,
                 hint: str = "") -> float | None:
    """``value`` as a float if it is a finite number within the bounds given.

    ``minimum``/``maximum`` are inclusive, ``above``/``below`` exclusive; ``optional``
    accepts None (returned as None).

    Example:
        >>> check_number("EMA decay", 0.99, above=0.0, below=1.0)
        0.99
        >>> check_number("GradClip max_norm", -1, above=0)
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: GradClip max_norm must be a finite number > 0, got -1.
    """
    if value is None and optional:
        return None
    bounds = [f"{sign} {bound:g}" for sign, bound in ((">=", minimum), (">", above),
                                                     ("<", below), ("<=", maximum))
              if bound is not None]
    requirement = "a finite number" + (f" {' and '.join(bounds)}" if bounds else "")
    if optional:
        requirement += " or None"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or (
            (minimum is not None and value < minimum) or (above is not None and value <= above)
            or (below is not None and value >= below) or (maximum is not None and value > maximum)):
        raise _refuse(label, requirement, value, hint)
    return float(value)


_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def check_duration(label: str, value: Any, *, hint: str = "") -> float:
    """``value`` as seconds > 0: a number of seconds, a ``datetime.timedelta``, or a string
    in SLURM's ``--time`` forms (``"MM"``, ``"MM:SS"``, ``"HH:MM:SS"``, ``"D-HH"``,
    ``"D-HH:MM"``, ``"D-HH:MM:SS"``). Only the first field may be as large as it likes
    (``"90"`` is 90 minutes): seconds and minutes after it are below 60 and hours after a
    day below 24, so ``"00:75"`` is refused, not read as 75 seconds.

    Example:
        >>> check_duration("TimeLimit duration", "1-02:30:00")
        95400.0
        >>> check_duration("TimeLimit duration", "90")  # minutes, as SLURM reads it
        5400.0
        >>> check_duration("TimeLimit duration", "00:75")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: TimeLimit duration '00:75' has 75 seconds, ... For 75 seconds write '01:15', ...
        >>> check_duration("TimeLimit duration", "soon")
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: TimeLimit duration must be seconds > 0, a timedelta or a time like '4:00:00' or '1-12:00:00', got 'soon'.
    """
    seconds: float | None = None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _SLURM_TIME.match(value.strip())):
        days, first, second, third = (int(part) if part else None for part in match.groups())
        if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
            fields = (("hours", first, 24), ("minutes", second, 60), ("seconds", third, 60))
            seconds = float(days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0))
        elif third is not None:  # HH:MM:SS
            fields = (("minutes", second, 60), ("seconds", third, 60))
            seconds = float(first * 3600 + (second or 0) * 60 + third)
        else:  # MM or MM:SS
            fields = (("seconds", second, 60),)
            seconds = float(first * 60 + (second or 0))
        _check_time_fields(label, value, fields, seconds, days is not None or third is not None)
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise _refuse(label, "seconds > 0, a timedelta or a time like '4:00:00' or "
                      "'1-12:00:00'", value, hint)
    return seconds


def _check_time_fields(label: str, value: str, fields: tuple[tuple[str, int | None, int], ...],
                       seconds: float, hours: bool) -> None:
    """A field of a SLURM time past its range (``"00:75"``: 75 seconds) is a typo, not a
    time: refused with the time it would have been, written as SLURM writes it."""
    for unit, number, limit in fields:
        if number is not None and number >= limit:
            whole = int(seconds)
            days, rest = divmod(whole, 86400)
            clock = (f"{rest // 3600:0{2 if days else 1}d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
                     if hours or days
                     else f"{rest // 60:02d}:{rest % 60:02d}")
            written = f"{days}-{clock}" if days else clock
            raise ConfigurationError(
                f"{label} {value!r} has {number} {unit}, but that field counts {unit} up to "
                f"{limit - 1} in SLURM's time forms ('MM:SS', 'HH:MM:SS', 'D-HH:MM:SS'). For "
                f"{whole} seconds write {written!r}, or give the seconds as a number "
                f"({whole}).")


def check_name(label: str, value: Any, *, optional: bool = True, hint: str = "") -> str | None:
    """``value`` if it is a non-empty string without ``/`` (a state key, a file-name part).

    Example:
        >>> check_name("EMA name", "ema_slow")
        'ema_slow'
        >>> check_name("EMA name", "")
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: EMA name must be a non-empty string without '/' or None, got ''.
    """
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or "/" in value:
        requirement = "a non-empty string without '/'" + (" or None" if optional else "")
        raise _refuse(label, requirement, value, hint)
    return value


def check_loss_reduction(value: Any, loss_fn: Any) -> str:
    """``Loop(loss_reduction=...)`` as ``"mean"`` or ``"sum"``; ``"auto"`` reads the
    ``reduction`` of a torch loss module (``nn.MSELoss(reduction="sum")``) or of a
    ``functools.partial`` (``partial(F.mse_loss, reduction="sum")``), else ``"mean"``.

    Example:
        >>> import torch
        >>> check_loss_reduction("auto", torch.nn.MSELoss(reduction="sum"))
        'sum'
        >>> check_loss_reduction("auto", torch.nn.functional.mse_loss)
        'mean'
        >>> import functools
        >>> check_loss_reduction("auto", functools.partial(torch.nn.functional.l1_loss,
        ...                                                reduction="sum"))
        'sum'
    """
    check_choice("Loop loss_reduction", value, ("auto", "mean", "sum"),
                 hint="'mean': each batch's loss is its mean (weighted by the batch size); "
                      "'sum': it is the sum over its samples; 'auto' reads loss_fn.reduction.")
    if value != "auto":
        return value
    if isinstance(loss_fn, functools.partial):  # partial(F.mse_loss, reduction="sum")
        reduction = loss_fn.keywords.get("reduction")
    else:
        reduction = getattr(loss_fn, "reduction", None)
    if reduction == "none":
        raise ConfigurationError(
            f"loss_fn {type(loss_fn).__name__}(reduction='none') returns one loss per sample, "
            "but the loop needs a scalar. Build it with reduction='mean' (or 'sum', then the "
            "epoch losses are divided by the number of samples).")
    return "sum" if reduction == "sum" else "mean"


def check_choice(label: str, value: Any, choices: Iterable[Any], *, hint: str = "") -> Any:
    """``value`` if it is one of ``choices``.

    Example:
        >>> check_choice("EarlyStopping mode", "max", ("auto", "min", "max"))
        'max'
        >>> check_choice("EarlyStopping mode", "up", ("auto", "min", "max"))
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: EarlyStopping mode must be one of 'auto', 'min', 'max', got 'up'.
    """
    options = tuple(choices)
    if isinstance(value, bool) or value not in options:
        listed = ", ".join(repr(option) for option in options)
        raise _refuse(label, f"one of {listed}", value, hint)
    return value


def check_that(label: str, value: Any, ok: bool, requirement: str, *, hint: str = "") -> Any:
    """``value`` when ``ok``: a check whose condition the caller computes, in the one form.

    Example:
        >>> check_that("FSDP wrap", 3, False, "a set of nn.Module classes")
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: FSDP wrap must be a set of nn.Module classes, got 3.
    """
    if not ok:
        raise _refuse(label, requirement, value, hint)
    return value


def check_path(label: str, value: Any, *, hint: str = "") -> str:
    """``value`` as a non-empty path string (``str`` or ``os.PathLike``).

    Example:
        >>> check_path("CSVLogger path", "runs/metrics.csv")
        'runs/metrics.csv'
    """
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return os.fspath(value)
    raise _refuse(label, "a file or directory path (a str or pathlib.Path)", value, hint)


def check_console(owner: str, console: Any) -> Any:
    """``console`` if it is None or a ``rich.console.Console`` (rich imported only then)."""
    if console is None:
        return None
    from rich.console import Console

    if not isinstance(console, Console):
        raise ConfigurationError(
            f"{owner} console must be a rich.console.Console (or None for the terminal), got "
            f"{type(console).__name__}.")
    return console


def available_devices() -> list[str]:
    """The devices this process can train on, e.g. ``['cpu']`` or ``['cpu', 'cuda:0']``.

    Example:
        >>> "cpu" in available_devices()
        True
    """
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        devices += [f"xpu:{index}" for index in range(xpu.device_count())]
    return devices


def default_device() -> torch.device:
    """CUDA when available, else Apple's MPS when available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_device(device: Any) -> torch.device:
    """The `torch.device` for ``device`` (None: `default_device`), if it exists.

    Args:
        device: None, a ``torch.device``, a string such as ``"cpu"`` or ``"cuda:1"``, or a
            CUDA device index.

    Raises:
        ConfigurationError: an unknown device name, or a device this machine does not
            have; the message lists the devices that exist.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
        >>> resolve_device("gpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: device='gpu' is not a device name torch knows. ...
    """
    if device is None:
        return default_device()
    existing = ", ".join(repr(name) for name in available_devices())
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ConfigurationError(
            f"device must be None, a string such as 'cpu' or 'cuda:0', a torch.device or a "
            f"CUDA index, got {device!r} ({type(device).__name__}). Devices here: {existing}.")
    if isinstance(device, int):
        if device < 0:
            raise ConfigurationError(f"device={device} is not a device index (>= 0). "
                                     f"Devices here: {existing}.")
        device = f"cuda:{device}"
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        hint = " For a GPU write 'cuda' (or 'cuda:0')." if str(device).lower().startswith("gpu") else ""
        raise ConfigurationError(
            f"device={device!r} is not a device name torch knows.{hint} Devices here: "
            f"{existing}.") from None
    kind = resolved.type
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigurationError(
                f"device={str(resolved)!r} but CUDA is not available in this process (no GPU "
                "visible, or a torch build without CUDA). Use device='cpu' or leave "
                f"device=None to use CUDA only where it exists. Devices here: {existing}.")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ConfigurationError(
                f"device={str(resolved)!r} but this machine has {torch.cuda.device_count()} "
                f"CUDA device(s). Devices here: {existing}.")
    elif kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigurationError(f"device='mps' but MPS is not available here. Devices "
                                     f"here: {existing}.")
    elif kind not in ("cpu", "meta"):
        backend = getattr(torch, kind, None)
        is_available = getattr(backend, "is_available", None)
        if callable(is_available) and not is_available():
            raise ConfigurationError(f"device={str(resolved)!r} is not available here. "
                                     f"Devices here: {existing}.")
    return resolved


def _check_data(data: Any, name: str) -> None:
    if data is None:
        raise ConfigurationError(
            f"{name} is None: pass an iterable of batches, usually "
            "torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True).")
    if isinstance(data, Dataset) and not isinstance(data, (IterableDataset, DataLoader)):
        raise ConfigurationError(
            f"{name} is {with_article(type(data).__name__)}, a torch Dataset: iterating it gives "
            "one sample at a time, not batches, so training would see batches of one sample "
            f"without a batch dimension. Wrap it: {name}=DataLoader(dataset, batch_size=32"
            f"{', shuffle=True' if name == 'train_data' else ''}).")
    if isinstance(data, (str, bytes, torch.Tensor)) or not (
            hasattr(data, "__iter__") or hasattr(data, "__getitem__")):
        raise ConfigurationError(
            f"{name} must be an iterable of batches (a DataLoader, a list of (inputs, "
            f"targets) pairs...), got {type(data).__name__}. A tensor of inputs needs "
            "targets and batching: DataLoader(TensorDataset(inputs, targets), batch_size=32).")


def _sample_problem(item: Any) -> str | None:
    """Why the first item of a list of training data looks like one sample, not a batch
    (None when it may be a batch): targets without a batch dimension (a number, a 0-d
    tensor), or 1-d inputs whose length is not the targets' (a batch's agree)."""
    if not isinstance(item, (tuple, list, Mapping)) or (
            isinstance(item, (tuple, list)) and len(item) != 2):
        return None
    targets = find_targets(item)
    inputs = item[0] if isinstance(item, (tuple, list)) else None
    if isinstance(targets, (int, float)) and not isinstance(targets, bool):
        return f"its targets are the number {targets!r}"
    if isinstance(targets, torch.Tensor) and targets.dim() == 0:
        return f"its targets are a 0-d tensor ({targets.item()!r})"
    if isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor) and \
            inputs.dim() == 1 and targets.dim() >= 1 and inputs.shape[0] != targets.shape[0]:
        return (f"its inputs have shape {tuple(inputs.shape)} and its targets "
                f"{tuple(targets.shape)}, while a batch's share the first (batch) dimension")
    return None


def _check_samples(data: Any, name: str) -> None:
    """A list of samples (``list(dataset)``) as the data: each step would see one sample
    without a batch dimension (a silent batch size of one, or torch's "mat1 and mat2")."""
    if not isinstance(data, (list, tuple)) or not data:
        return
    problem = _sample_problem(data[0])
    if problem is not None:
        raise ConfigurationError(
            f"{name} looks like a list of samples, not of batches: its first item is "
            f"{with_article(type(data[0]).__name__)} and {problem}, so every step would train "
            "on one sample without a batch dimension. For a list of samples: wrap it in a "
            f"DataLoader, {name}=DataLoader(samples, batch_size=32"
            f"{', shuffle=True' if name == 'train_data' else ''}), which stacks them into "
            "batches (or pass forward=fn(loop, batch) -> (outputs, loss) if each item is "
            "meant as it is).")


def _check_callable(value: Any, name: str, signature: str) -> None:
    if value is None:
        return
    if isinstance(value, type):
        raise ConfigurationError(
            f"{name} is the class {value.__name__}, not an instance or a function: write "
            f"{name}={value.__name__}() (it is called as {signature}).")
    if not callable(value):
        raise ConfigurationError(
            f"{name} must be a function {signature} or None, got {value!r} "
            f"({type(value).__name__}).")


def check_extra_state(state: Any, model: Any = None, optimizer: Any = None) -> dict[str, Any]:
    """``Loop(state=...)``: names mapped to objects with ``state_dict`` and ``load_state_dict``.

    Refused: a class instead of an instance (``state={"d": nn.Linear}`` has the methods,
    unbound, and failed at the first save); one object under two names (restored twice);
    the loop's own ``model`` or ``optimizer`` (saved already). What the objects' states
    hold is checked at fit start (`hookloop.run_state.check_callback_states`).

    Example:
        >>> import torch
        >>> sorted(check_extra_state({"discriminator": torch.nn.Linear(2, 1)}))
        ['discriminator']
        >>> check_extra_state({"discriminator": torch.nn.Linear})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: Loop state['discriminator'] is the class Linear, not an instance: ...
    """
    if state is None:
        return {}
    if not isinstance(state, dict) or isinstance(state, nn.Module):
        raise ConfigurationError(
            f"Loop state must be a dict of name -> object with state_dict/load_state_dict "
            f"(e.g. state={{'discriminator': net_d, 'opt_d': opt_d}}), got {type(state).__name__}.")
    names: dict[int, str] = {}
    for name, item in state.items():
        check_name("Loop state key", name, optional=False)
        if isinstance(item, type):
            raise ConfigurationError(
                f"Loop state[{name!r}] is the class {item.__name__}, not an instance: its "
                "state_dict could not be saved. Pass the object the run uses: "
                f"state={{{name!r}: {item.__name__[:1].lower() + item.__name__[1:]}}} where "
                f"{item.__name__[:1].lower() + item.__name__[1:]} = {item.__name__}(...).")
        if not (callable(getattr(item, "state_dict", None))
                and callable(getattr(item, "load_state_dict", None))):
            raise ConfigurationError(
                f"Loop state[{name!r}] (of type {type(item).__name__}) has no state_dict() and "
                "load_state_dict(): the loop saves and restores each object of state= through "
                "them (a module, an optimizer, a scheduler, a GradScaler...).")
        for own, what in ((model, "model"), (optimizer, "optimizer")):
            if item is own:
                raise ConfigurationError(
                    f"Loop state[{name!r}] is the loop's {what}, which the run saves and "
                    f"restores already (under {what!r}): remove it from state=.")
        if id(item) in names:
            raise ConfigurationError(
                f"Loop state[{names[id(item)]!r}] and state[{name!r}] are the same "
                f"{type(item).__name__} object: it would be saved twice and restored twice. "
                "Keep one name for it.")
        names[id(item)] = name
    return dict(state)


def _check_selector(label: str, selector: Any) -> None:
    """``Loop(inputs=..., targets=...)``: None, a key (str or int) or a function of a batch."""
    if selector is None or (isinstance(selector, str) and selector) or (
            _is_int(selector) and selector >= 0):
        return
    if callable(selector) and not isinstance(selector, type):
        _check_arity(selector, label, 1, f"{label}(batch)", "It gets the batch and returns "
                     f"the {label}.")
        return
    raise _refuse(f"Loop {label}", "a key of the batch (e.g. 'image'), an index, or a function "
                  "fn(batch)", selector)


def _check_arity(function: Any, name: str, count: int, call: str, hint: str) -> None:
    """``function`` must accept ``count`` positional arguments, as the loop will call it.

    Read from its signature (no call is made); a function whose signature cannot be read
    (some builtins) passes.
    """
    if function is None:
        return
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(count))
    except TypeError:
        label = getattr(function, "__qualname__", None) or type(function).__name__
        raise ConfigurationError(
            f"{name} is called as {call}, with {count} arguments, but {label}{signature} "
            f"cannot take them. {hint}") from None


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    if not callable(getattr(optimizer, "step", None)) or not hasattr(optimizer, "param_groups"):
        raise ConfigurationError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}. "
            "Create one over the model's parameters: torch.optim.AdamW(model.parameters()).")
    for index, group in enumerate(optimizer.param_groups):
        rate = group.get("lr")
        if isinstance(rate, torch.Tensor) and rate.numel() == 1:
            rate = float(rate)  # read once, when the loop is built
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and (
                rate < 0 or not math.isfinite(rate)):
            raise ConfigurationError(
                f"The optimizer's param group {index} has the learning rate {rate!r}: a "
                "negative (or non-finite) rate moves the weights up the gradient, so the loss "
                "would grow. Give a rate > 0, e.g. torch.optim.AdamW(model.parameters(), "
                "lr=3e-4) (lr_find suggests one); to leave a part of the model as it is, "
                "freeze it (parameter.requires_grad_(False)) or give its group lr=0.")
    model_parameters = {id(parameter) for parameter in model.parameters()}
    optimized = [parameter for group in optimizer.param_groups
                 for parameter in group.get("params", ())]
    if model_parameters and optimized and not any(id(parameter) in model_parameters
                                                  for parameter in optimized):
        raise ConfigurationError(
            f"The optimizer holds {len(optimized)} parameter tensor(s), none of which is a "
            f"parameter of the model ({type(model).__name__}), so training would change "
            "nothing. Create the optimizer from this model: "
            "torch.optim.AdamW(model.parameters()), after building (or replacing) the model.")


def _function_name(function: Any) -> str:
    """How a user wrote the function: ``presets.standard``, ``make_callbacks``."""
    module = getattr(function, "__module__", "") or ""
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"presets.{name}" if module == "hookloop.presets" else name


def check_loop_arguments(model: Any, optimizer: Any, train_data: Any, val_data: Any,
                         loss_fn: Any, forward: Any, callbacks: Any, device: Any, *,
                         val_every_n_epochs: Any = 1, val_every_n_steps: Any = None,
                         sanity_val_batches: Any = 2, inputs: Any = None,
                         targets: Any = None, val_at_start: Any = False) -> torch.device:
    """Check `Loop`'s arguments when it is built; return the device to train on.

    Checks: a ``nn.Module`` model; an optimizer with at least one of the model's
    parameters; ``train_data`` (and ``val_data`` when given) iterable batches, not None,
    not a torch ``Dataset`` (it yields single samples: wrap it in a DataLoader), not a
    list of samples (its first item's targets without a batch dimension);
    ``loss_fn`` and ``forward`` callables (not classes) or None; ``callbacks`` a list of
    `Callback` instances (not None, not one callback); a device that exists here.

    Returns:
        The resolved device (see `resolve_device`).

    Raises:
        ConfigurationError: naming the argument, the problem and the fix.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> check_loop_arguments(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                      [(torch.ones(1, 2), torch.ones(1, 1))], None,
        ...                      torch.nn.functional.mse_loss, None, [], "cpu")
        device(type='cpu')
    """
    if not isinstance(model, nn.Module):
        raise ConfigurationError(
            f"model must be a torch.nn.Module, got {type(model).__name__}.")
    _check_optimizer(model, optimizer)
    _check_data(train_data, "train_data")
    if val_data is not None:
        _check_data(val_data, "val_data")
    if forward is None:  # a forward of its own may take single samples on purpose
        _check_samples(train_data, "train_data")
        if val_data is not None:
            _check_samples(val_data, "val_data")
    _check_callable(loss_fn, "loss_fn", "fn(outputs, targets) -> scalar loss")
    _check_arity(loss_fn, "loss_fn", 2, "loss_fn(outputs, targets)",
                 "For a loss that needs only the outputs, or more than the targets, pass "
                 "forward=fn(loop, batch) -> (outputs, loss) instead.")
    _check_arity(forward, "forward", 2, "forward(loop, batch)",
                 "It must return (outputs, loss).")
    _check_callable(forward, "forward", "fn(loop, batch) -> (outputs, loss)")
    if callbacks is None:
        raise ConfigurationError(
            "callbacks is None: pass a list of callbacks (callbacks=[AMP(), Checkpoint(...)]) "
            "or leave the argument out for none.")
    if isinstance(callbacks, Callback):
        raise ConfigurationError("callbacks must be a list of callbacks: callbacks=[...].")
    if inspect.isfunction(callbacks) or inspect.ismethod(callbacks):
        name = _function_name(callbacks)
        raise ConfigurationError(
            f"callbacks is the function {name}, not a list: call it, callbacks={name}(...) "
            "(a preset is a function that returns the list of callbacks).")
    if isinstance(callbacks, (str, bytes, dict)) or not isinstance(callbacks, Iterable):
        raise ConfigurationError(
            f"callbacks must be a list of Callback instances, got {type(callbacks).__name__}.")
    if isinstance(callbacks, (list, tuple)):
        for index, callback in enumerate(callbacks):
            if isinstance(callback, type) and issubclass(callback, Callback):
                raise ConfigurationError(
                    f"callbacks[{index}] is the class {callback.__name__}, not an instance: "
                    f"write {callback.__name__}(...) in the list.")
            if inspect.isfunction(callback) or inspect.ismethod(callback):
                name = _function_name(callback)
                raise ConfigurationError(
                    f"callbacks[{index}] is the function {name}, not a callback: call it. A "
                    f"function returning a list of callbacks (a preset) goes in as "
                    f"callbacks={name}(...), or joined to others: [*{name}(...), MyCallback()].")
            if not isinstance(callback, Callback):
                raise ConfigurationError(
                    f"callbacks[{index}] is {callback!r} ({type(callback).__name__}), not a "
                    "hookloop.Callback. Subclass hookloop.Callback and pass an instance.")
    for label, selector in (("inputs", inputs), ("targets", targets)):
        _check_selector(label, selector)
    check_optional_int("Loop val_every_n_epochs", val_every_n_epochs)
    check_optional_int("Loop val_every_n_steps", val_every_n_steps)
    check_int("Loop sanity_val_batches", sanity_val_batches, minimum=0,
              hint="(0 turns the check off.)")
    if check_flag("Loop val_at_start", val_at_start) and val_data is None:
        raise ConfigurationError("Loop(val_at_start=True) validates before the first training "
                                 "step, but there is no val_data: pass val_data=loader, or "
                                 "leave val_at_start out.")
    return resolve_device(device)


def _one_shot(data: Any) -> bool:
    """True for an iterator (a generator...): iterating it a second time yields nothing."""
    return isinstance(data, Iterator)


def check_fit_data(train_data: Any, epochs_left: int, val_data: Any = None) -> None:
    """At ``fit`` start: refuse one-shot data that would run dry after the first epoch.

    A generator (any iterator: ``iter(x) is x``) is used up by one pass; with more than one
    epoch left, the second epoch would find it empty. Validation runs every epoch, so a
    one-shot ``val_data`` is refused likewise.

    Args:
        train_data: The loop's training data.
        epochs_left: Epochs this fit still runs (a resumed run counts what is left; an
            epoch cut short by ``stop()`` and continued counts as one).
        val_data: The loop's validation data, or None.

    Raises:
        ConfigurationError: naming the argument and the fix.

    Example:
        >>> check_fit_data([1, 2], epochs_left=3)          # a list can be iterated again
        >>> check_fit_data((b for b in [1, 2]), epochs_left=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: train_data is a generator, a one-shot iterator: ...
    """
    for data, name in ((train_data, "train_data"), (val_data, "val_data")):
        if data is not None and _one_shot(data) and epochs_left > 1:
            raise ConfigurationError(
                f"{name} is {with_article(type(data).__name__)}, a one-shot iterator: it is used "
                f"up after one pass, but this fit runs {epochs_left} more epochs, and the next "
                f"would find it empty. Pass something that can be iterated again: a list, a "
                "DataLoader, or an object whose __iter__ returns a new generator "
                "(class Batches: def __iter__(self): yield from make_batches()).")


def check_fit(loop: Any, epochs: Any, max_steps: Any, min_epochs: Any = None,
              min_steps: Any = None) -> None:
    """At ``fit``: its arguments (`check_fit_arguments`), the callback stack
    (`hookloop.ordering.check_callbacks`) and one-shot data (`check_fit_data`)."""
    check_fit_arguments(epochs, max_steps, min_epochs, min_steps)
    check_callbacks(loop.callbacks, loop)  # a stack that cannot work: nothing ran yet
    check_fit_data(loop.train_data, epochs - loop.position.epoch, loop.val_data)
    check_batch_rule(loop, _first_sample(loop.train_data))


def _first_sample(data: Any) -> Any:
    """The first batch of a list, or the first sample of a DataLoader's map-style dataset,
    read without iterating the data (and without changing any random stream); else None."""
    if isinstance(data, (list, tuple)):
        return data[0] if data else None
    dataset = getattr(data, "dataset", None)
    if isinstance(data, DataLoader) and not isinstance(dataset, IterableDataset) and \
            length_of(dataset):
        with untouched():
            try:
                return dataset[0]
            except Exception:  # the loader will show its own error where it has one
                return None
    return None


def check_fit_arguments(epochs: Any, max_steps: Any, min_epochs: Any = None,
                        min_steps: Any = None) -> None:
    """``fit``'s own arguments: ``epochs`` an int >= 0, ``max_steps`` None or an int >= 1,
    ``min_epochs`` None or an int from 1 to ``epochs``, ``min_steps`` None or an int >= 1
    and not above ``max_steps``.

    Bools are refused (``max_steps=True`` would silently mean one step).

    Raises:
        ConfigurationError: naming the argument.

    Example:
        >>> check_fit_arguments(3, None)
        >>> check_fit_arguments(3, True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: max_steps must be a positive int or None, got True...
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ConfigurationError(
            f"epochs must be a non-negative int (the total number of epochs of the run), got "
            f"{epochs!r}.")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)
                                  or max_steps < 1):
        raise ConfigurationError(
            f"max_steps must be a positive int or None, got {max_steps!r} "
            f"({type(max_steps).__name__}).")
    check_optional_int("fit min_epochs", min_epochs)
    check_optional_int("fit min_steps", min_steps)
    if min_epochs is not None and min_epochs > epochs:
        raise ConfigurationError(
            f"fit min_epochs={min_epochs} is more than epochs={epochs}: training could never "
            f"reach it. Pass epochs >= {min_epochs}, or a smaller min_epochs.")
    if min_steps is not None and max_steps is not None and min_steps > max_steps:
        raise ConfigurationError(
            f"fit min_steps={min_steps} is more than max_steps={max_steps}: training could "
            f"never reach it. Pass max_steps >= {min_steps}, or a smaller min_steps.")


def check_evaluation(data: Any, prefix: Any) -> None:
    """`Loop.evaluate`'s arguments: some data, and a prefix that makes metric names."""
    if not isinstance(prefix, str) or not prefix.isidentifier():
        raise ConfigurationError(f"prefix must be a name such as 'test', got {prefix!r}.")
    if data is None:
        raise ConfigurationError("evaluate() needs data to evaluate, got None.")


def check_setup(loop: Any) -> None:
    """After every ``setup`` hook ran (DDP may have rebuilt the data): the step geometry and
    the data are usable.

    Raises:
        ConfigurationError: ``accumulation_steps`` set to something else than an int >= 1,
            empty training data, or empty validation data in a single process (under DDP
            one rank's shard may be empty; the validation pass checks the total).
    """
    check_int("Loop accumulation_steps (set by a callback's setup)", loop.accumulation_steps)
    if length_of(loop.train_data) == 0:
        raise ConfigurationError(
            "train_data is empty (len(train_data) == 0): check the dataset, the batch size "
            "and drop_last.")
    if loop.val_data is not None and length_of(loop.val_data) == 0 and distributed.world_size() == 1:
        raise ConfigurationError("val_data is empty (len(val_data) == 0): pass val_data=None "
                                 "to train without validation, or check the dataset.")
