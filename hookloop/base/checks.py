"""Argument checks: the generic ones every constructor uses, and the device's.

Each mistake found here would otherwise fail late (after an epoch), raw (a TypeError
from deep inside torch), or not at all (training nothing). Every error names the argument,
what is wrong with it and the fix, in one form::

    EarlyStopping patience must be an int >= 1, got 0.

The generic checks (`check_int`, `check_optional_int`, `check_flag`, `check_number`,
`check_name`, `check_choice`, `check_path`) take the label first (the owner and the
argument: ``"EarlyStopping patience"``) and return the value they accepted, so a
constructor reads ``self.patience = check_int("EarlyStopping patience", patience)``.
The checks of the `Loop`'s own arguments are in `hookloop.engine.arguments`.
"""

from __future__ import annotations

import datetime
import math
import os
import re
from collections.abc import Iterable
from typing import Any, Literal, overload

import torch

from hookloop.errors import ConfigurationError

__all__ = ["check_int", "check_optional_int", "check_flag", "check_number", "check_duration",
           "check_name", "check_choice", "check_path", "check_console", "resolve_device",
           "available_devices", "check_that", "is_int", "refusal"]


def refusal(label: str, requirement: str, value: Any, hint: str = "") -> ConfigurationError:
    """The one message form: ``{label} must be {requirement}, got {value!r}. {hint}``."""
    return ConfigurationError(f"{label} must be {requirement}, got {value!r}."
                              + (f" {hint}" if hint else ""))


def is_int(value: Any) -> bool:
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
    if not is_int(value) or value < minimum:
        raise refusal(label, f"an int >= {minimum}", value, hint)
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
    if not is_int(value) or value < minimum:
        raise refusal(label, f"an int >= {minimum} or None", value, hint)
    return value


def check_flag(label: str, value: Any, *, hint: str = "") -> bool:
    """``value`` if it is True or False (not 0, 1 or None).

    Example:
        >>> check_flag("TensorBoard graph", True)
        True
    """
    if not isinstance(value, bool):
        raise refusal(label, "True or False", value, hint)
    return value


@overload
def check_number(label: str, value: Any, *, minimum: float | None = ...,
                 above: float | None = ..., below: float | None = ...,
                 maximum: float | None = ..., optional: Literal[False] = ...,
                 hint: str = ...) -> float: ...
@overload
def check_number(label: str, value: Any, *, minimum: float | None = ...,
                 above: float | None = ..., below: float | None = ...,
                 maximum: float | None = ..., optional: bool,
                 hint: str = ...) -> float | None: ...
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
        raise refusal(label, requirement, value, hint)
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
        days, first_field, second, third = (int(part) if part else None
                                            for part in match.groups())
        first = first_field or 0  # always matched: the pattern requires it
        fields: tuple[tuple[str, int | None, int], ...]
        if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
            fields = (("hours", first, 24), ("minutes", second, 60), ("seconds", third, 60))
            seconds = float(days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0))
        elif third is not None:  # HH:MM:SS
            fields = (("minutes", second, 60), ("seconds", third, 60))
            seconds = float(first * 3600 + (second or 0) * 60 + (third or 0))
        else:  # MM or MM:SS
            fields = (("seconds", second, 60),)
            seconds = float(first * 60 + (second or 0))
        _check_time_fields(label, value, fields, seconds, days is not None or third is not None)
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise refusal(label, "seconds > 0, a timedelta or a time like '4:00:00' or "
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
        raise refusal(label, requirement, value, hint)
    return value


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
        raise refusal(label, f"one of {listed}", value, hint)
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
        raise refusal(label, requirement, value, hint)
    return value


def check_path(label: str, value: Any, *, hint: str = "") -> str:
    """``value`` as a non-empty path string (``str`` or ``os.PathLike``).

    Example:
        >>> check_path("CSVLogger path", "runs/metrics.csv")
        'runs/metrics.csv'
    """
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return os.fspath(value)
    raise refusal(label, "a file or directory path (a str or pathlib.Path)", value, hint)


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
