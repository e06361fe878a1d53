"""Presets: named, parameterised callback stacks, built in or installed from other packages.

A preset is a plain function that returns a list of callbacks. Nothing is hidden: print
the list, edit it like any list, and pass it to `Loop`::

    callbacks = presets.standard(checkpoint_dir="ckpt/run1", metrics={"acc": accuracy},
                                 monitor="val_acc")
    callbacks.insert(0, PrintLoss())                         # insert one
    presets.replace(callbacks, EMA, None)                    # remove one
    presets.replace(callbacks, GradClip, GradClip(0.5))      # replace one, same position

Built-in presets: `standard`, `finetune` and `debug`. Other packages publish theirs through
the entry-point group ``hookloop.presets`` (see ``docs/presets.md``); `available` lists
every preset installed, and `get` builds one by name. Presets are only ever used when asked
for by name: installing a package never changes a stack you did not ask it to build.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import inspect
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.callbacks.detect_anomaly import DetectAnomaly
from hookloop.callbacks.short_run import ShortRun
from hookloop.errors import ConfigurationError
from hookloop.monitor import Monitor

__all__ = [
    "ENTRY_POINT_GROUP",
    "DetectAnomaly",
    "ShortRun",
    "available",
    "debug",
    "finetune",
    "get",
    "replace",
    "standard",
]

#: The entry-point group other packages publish their presets in.
ENTRY_POINT_GROUP = "hookloop.presets"

_SCHEDULES = ("warmup_cosine", "warmup_linear")
_AMP_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
              torch.bfloat16: "bf16", torch.float16: "fp16"}


# ------------------------------------------------------------------ built-in presets
def standard(
    *,
    amp: str | torch.dtype | None = "bf16",
    clip: float | None = 1.0,
    accumulate: int | None = 1,
    ema: float | None = 0.999,
    schedule: str | Callable[[torch.optim.Optimizer, int], Any] | None = "warmup_cosine",
    warmup: int | float = 0.05,
    checkpoint_dir: str | os.PathLike[str] | None = "ckpt",
    tensorboard: str | os.PathLike[str] | None = "runs",
    early_stopping: int | None = 5,
    metrics: Mapping[str, Any] | Callback | None = None,
    monitor: str | None = "val_loss",
    mode: str = "auto",
    resume: bool | str | os.PathLike[str] = False,
    progress: bool = True,
) -> list[Callback]:
    """Mixed precision, clipping, EMA, warmup-cosine, metrics, early stopping, checkpoints, logs.

    The stack, in this order (each part is left out when its argument is None, False or
    0; ``accumulate=1`` means no accumulation)::

        AMP -> GradAccumulation -> GradClip -> EMA -> LRScheduler -> Metrics
            -> EarlyStopping -> TensorBoard -> ProgressBar -> Checkpoint

    AMP comes before GradClip (gradients are unscaled before clipping), Metrics before the
    callbacks that monitor its values, and Checkpoint after every stateful callback.

    Args:
        amp: ``"bf16"`` or ``"fp16"`` (a GradScaler is added for fp16), or a torch dtype.
        clip: Maximum total gradient norm (``GradClip(clip)``).
        accumulate: Micro-batches per optimizer step (``GradAccumulation``); 1, 0, False
            or None: one batch per step (no ``GradAccumulation``).
        ema: Decay of the weights' moving average (``EMA(ema)``); validation and
            ``best.pt`` then use the averaged weights.
        schedule: ``"warmup_cosine"``, ``"warmup_linear"``, or a factory
            ``fn(optimizer, total_steps) -> scheduler`` (stepped after every optimizer step).
        warmup: Warmup of the named schedules: a number of steps, or a fraction
            ``0 < x < 1`` of the run's steps.
        checkpoint_dir: Directory of the resumable checkpoints and ``best.pt``.
        tensorboard: Directory of the TensorBoard event files.
        early_stopping: Patience in validations without improvement of ``monitor`` (ignored
            when ``monitor`` is None).
        metrics: ``{"acc": fn(outputs, targets)}`` for ``Metrics(**metrics)``, or a
            ready ``Metrics(...)`` callback.
        monitor: The metric early stopping and ``best.pt`` follow (``"val_acc"`` needs
            ``metrics={"acc": ...}``; ``"train_loss"`` for a run without validation data).
            None: no early stopping (whatever ``early_stopping`` says) and no ``best.pt``.
        mode: ``"min"``, ``"max"``, or ``"auto"``: max for accuracy-like names (acc, f1,
            auc, precision, recall, iou, score...), min for loss-like ones (loss, error,
            perplexity...).
        resume: ``Checkpoint(resume=...)``: True continues from the newest checkpoint in
            ``checkpoint_dir`` (a fresh start when there is none), a path from that file.
        progress: Show the progress display (``ProgressBar``).

    Returns:
        A new list of callbacks, to pass to ``Loop(..., callbacks=...)`` or to edit.

    Raises:
        ConfigurationError: a value the stack cannot use, named with the argument.

    Example:
        >>> from hookloop import presets
        >>> callbacks = presets.standard(tensorboard=None, progress=False, ema=None)
        >>> [type(callback).__name__ for callback in callbacks]
        ['AMP', 'GradClip', 'LRScheduler', 'EarlyStopping', 'Checkpoint']
    """
    from hookloop.callbacks import (
        AMP,
        EMA,
        Checkpoint,
        EarlyStopping,
        GradAccumulation,
        GradClip,
        LRScheduler,
        Metrics,
    )

    callbacks: list[Callback] = []
    if amp:
        if not isinstance(amp, (str, torch.dtype)) or amp not in _AMP_NAMES:
            raise ConfigurationError(
                f"standard(amp={amp!r}): use 'bf16' or 'fp16' (or a torch dtype), or None to "
                "train in full precision.")
        callbacks.append(AMP(_AMP_NAMES[amp]))
    if accumulate is True or accumulate not in (None, False, 0, 1):  # True == 1: refused
        _check_count("standard(accumulate=...)", accumulate, minimum=1)
        callbacks.append(GradAccumulation(accumulate))
    if clip:
        _check_positive("standard(clip=...)", clip)
        callbacks.append(GradClip(float(clip)))
    if ema:
        callbacks.append(EMA(ema))
    if schedule:
        callbacks.append(LRScheduler(_schedule_factory(schedule, warmup)))
    if metrics is not None:
        if isinstance(metrics, Callback):
            callbacks.append(metrics)
        elif isinstance(metrics, Mapping) and metrics:
            callbacks.append(Metrics(**metrics))
        else:
            raise ConfigurationError(
                f"standard(metrics={metrics!r}): pass a dict of metric functions, e.g. "
                "metrics={'acc': accuracy}, or a Metrics(...) callback.")
    resolved = Monitor(monitor, mode, owner="standard()").resolve() if monitor else None
    if early_stopping and monitor:  # monitor=None switches early stopping off
        _check_count("standard(early_stopping=...)", early_stopping, minimum=1)
        callbacks.append(EarlyStopping(monitor=monitor, mode=resolved, patience=early_stopping))
    if tensorboard:
        from hookloop.callbacks import TensorBoard

        callbacks.append(TensorBoard(os.fspath(tensorboard)))
    if progress:
        from hookloop.callbacks import ProgressBar

        callbacks.append(ProgressBar())
    if checkpoint_dir:
        callbacks.append(Checkpoint(checkpoint_dir, monitor=monitor or None,
                                    mode=resolved or "min", resume=resume))
    return callbacks


def finetune(
    *,
    amp: str | torch.dtype | None = "bf16",
    clip: float | None = 1.0,
    accumulate: int | None = 1,
    ema: float | None = None,
    schedule: str | Callable[[torch.optim.Optimizer, int], Any] | None = "warmup_linear",
    warmup: int | float = 0.1,
    checkpoint_dir: str | os.PathLike[str] | None = "ckpt",
    tensorboard: str | os.PathLike[str] | None = "runs",
    early_stopping: int | None = None,
    metrics: Mapping[str, Any] | Callback | None = None,
    monitor: str | None = "val_loss",
    mode: str = "auto",
    resume: bool | str | os.PathLike[str] = False,
    progress: bool = True,
) -> list[Callback]:
    """Fine-tune a pretrained model: bf16, clipping at 1.0, warmup then linear decay, no EMA.

    The usual recipe for a pretrained transformer-style model (a short run at a small
    learning rate, e.g. AdamW at 2e-5): 10% of the steps of linear warmup, then a linear
    decay to 0 (``schedule="warmup_cosine"`` for a cosine decay), gradients clipped at a
    total norm of 1.0, no weight averaging and no early stopping. It is `standard` with
    those defaults; every argument means the same as there.

    Returns:
        A new list of callbacks.

    Example:
        >>> from hookloop import presets
        >>> callbacks = presets.finetune(tensorboard=None, progress=False, checkpoint_dir=None)
        >>> [type(callback).__name__ for callback in callbacks]
        ['AMP', 'GradClip', 'LRScheduler']
    """
    return standard(amp=amp, clip=clip, accumulate=accumulate, ema=ema, schedule=schedule,
                    warmup=warmup, checkpoint_dir=checkpoint_dir, tensorboard=tensorboard,
                    early_stopping=early_stopping, metrics=metrics, monitor=monitor, mode=mode,
                    resume=resume, progress=progress)


def debug(
    *,
    steps: int | None = 20,
    anomaly_steps: int | None = 5,
    summary: bool = True,
    input_size: Any = None,
    depth: int = 3,
    profile: bool = True,
) -> list[Callback]:
    """A short, watchful first run: model summary, NaN check, anomaly detection, profiler.

    The stack: ``ModelSummary`` (a torchinfo table at fit start), ``TerminateOnNaN`` (stop
    at the first non-finite loss, before it reaches the weights), `DetectAnomaly` (autograd
    anomaly detection for the first ``anomaly_steps`` steps: the forward line that made a
    NaN gradient), `ShortRun` (end after ``steps`` optimizer steps) and ``Profiler`` (time
    per callback and phase, printed at fit end). Put it in front of another stack to check
    that one: ``presets.debug() + presets.standard(...)``.

    Args:
        steps: Optimizer steps of the run; None runs the whole fit.
        anomaly_steps: Steps with anomaly detection (slow); None: off.
        summary: Print the model summary.
        input_size: Input shape for the summary; None takes it from the first batch.
        depth: Depth of nested modules in the summary.
        profile: Time callbacks and phases.

    Returns:
        A new list of callbacks.

    Example:
        >>> from hookloop import presets
        >>> callbacks = presets.debug(summary=False, profile=False)
        >>> [type(callback).__name__ for callback in callbacks]
        ['TerminateOnNaN', 'DetectAnomaly', 'ShortRun']
    """
    from hookloop.callbacks import TerminateOnNaN

    callbacks: list[Callback] = []
    if summary:
        from hookloop.callbacks import ModelSummary

        callbacks.append(ModelSummary(input_size=input_size, depth=depth))
    callbacks.append(TerminateOnNaN())
    if anomaly_steps:
        callbacks.append(DetectAnomaly(anomaly_steps))
    if steps:
        callbacks.append(ShortRun(steps))
    if profile:
        from hookloop.callbacks import Profiler

        callbacks.append(Profiler())
    return callbacks


_BUILT_IN: dict[str, Callable[..., list[Callback]]] = {
    "standard": standard,
    "finetune": finetune,
    "debug": debug,
}


# ------------------------------------------------------------------ editing a stack
def replace(callbacks: list[Callback], kind: type[Callback] | str,
            new: Callback | None) -> list[Callback]:
    """Replace, in place, the callback of class (or state key) ``kind`` by ``new``.

    The new callback takes the old one's position, so the order rules still hold.
    ``new=None`` removes it.

    Args:
        callbacks: A stack, e.g. returned by a preset.
        kind: A callback class (subclasses match too) or a state key such as ``"EMA"``.
        new: The callback to put in its place, or None to remove it.

    Returns:
        The same list, for chaining.

    Raises:
        ConfigurationError: when no callback or more than one matches ``kind``.

    Example:
        >>> from hookloop import presets
        >>> from hookloop.callbacks import GradClip
        >>> callbacks = presets.standard(tensorboard=None, progress=False)
        >>> _ = presets.replace(callbacks, GradClip, GradClip(0.5))
        >>> _ = presets.replace(callbacks, "EMA", None)
        >>> [type(callback).__name__ for callback in callbacks][:3]
        ['AMP', 'GradClip', 'LRScheduler']
    """
    if isinstance(kind, str):
        found = [index for index, callback in enumerate(callbacks) if callback.state_key == kind]
        label = repr(kind)
    else:
        found = [index for index, callback in enumerate(callbacks) if isinstance(callback, kind)]
        label = kind.__name__
    if len(found) != 1:
        listed = ", ".join(repr(callback) for callback in callbacks)
        problem = "no callback" if not found else f"{len(found)} callbacks"
        raise ConfigurationError(
            f"replace: {problem} in the stack match {label}; the stack is [{listed}]. "
            "Pass a class or state key that names exactly one of them.")
    if new is None:
        del callbacks[found[0]]
    else:
        callbacks[found[0]] = new
    return callbacks


# ------------------------------------------------------------------ lookup
@dataclass(frozen=True)
class _Entry:
    """One preset found: built in, or published by a package through the entry point."""

    name: str
    package: str
    function: Callable[..., list[Callback]] | None = None
    problem: str | None = None

    @property
    def description(self) -> str:
        if self.function is None:
            return f"not usable: {self.problem}"
        doc = inspect.getdoc(self.function) or ""
        return doc.strip().splitlines()[0] if doc.strip() else "(no description)"


def _package_of(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return f"unknown package ({entry_point.value})"
    return f"{dist.name} {dist.version}"


def _discover() -> tuple[dict[str, _Entry], list[_Entry]]:
    """Built-in and installed presets by name, and the installed ones that cannot be used.

    Entry points are loaded one by one: one that fails to import, is not callable, takes a
    built-in name or is published by two packages is set aside with the reason, and the
    others stay usable.
    """
    usable = {name: _Entry(name, "hookloop", function) for name, function in _BUILT_IN.items()}
    problems: list[_Entry] = []
    by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        by_name.setdefault(entry_point.name, []).append(entry_point)
    for name in sorted(by_name):
        entry_points = by_name[name]
        packages = ", ".join(_package_of(entry_point) for entry_point in entry_points)
        if name in usable:
            problems.append(_Entry(name, packages, problem=(
                f"{name!r} is the name of a built-in preset, which keeps it; the package "
                "must publish its preset under another name")))
            continue
        if len(entry_points) > 1:
            problems.append(_Entry(name, packages, problem=(
                f"{len(entry_points)} installed packages publish a preset named {name!r}, so "
                "none of them is used; uninstall all but one")))
            continue
        entry_point = entry_points[0]
        try:
            function = entry_point.load()
        except Exception as error:  # any import-time failure of someone else's package
            problems.append(_Entry(name, packages, problem=(
                f"loading {entry_point.value} failed with {type(error).__name__}: {error}")))
            continue
        if not callable(function):
            problems.append(_Entry(name, packages, problem=(
                f"{entry_point.value} is a {type(function).__name__}, not a function "
                "returning a list of callbacks")))
            continue
        usable[name] = _Entry(name, packages, function)
    return usable, problems


def _warn(problems: list[_Entry]) -> None:
    for entry in problems:
        warnings.warn(f"hookloop preset {entry.name!r} from {entry.package} is not available: "
                      f"{entry.problem}.", RuntimeWarning, stacklevel=3)


def available() -> dict[str, str]:
    """Every preset that `get` can build: ``{name: one-line description}``, sorted by name.

    Built-in presets come first in meaning, not in order: a package cannot replace them.
    An installed preset that cannot be used (its package fails to import, it takes a
    built-in name, two packages publish the same name) is left out with a warning naming
    it and its package; the others are listed. ``hookloop presets`` prints the same list
    with the package each preset comes from.

    Returns:
        Preset names mapped to the first line of their docstring.

    Example:
        >>> from hookloop import presets
        >>> sorted(set(presets.available()) & {"standard", "finetune", "debug"})
        ['debug', 'finetune', 'standard']
    """
    usable, problems = _discover()
    _warn(problems)
    return {name: usable[name].description for name in sorted(usable)}


def get(name: str, **kwargs: Any) -> list[Callback]:
    """Build the preset called ``name`` with ``kwargs``: ``get("standard", ema=None)``.

    Args:
        name: A built-in preset (``"standard"``, ``"finetune"``, ``"debug"``) or one an
            installed package publishes (see `available`).
        **kwargs: The preset's arguments.

    Returns:
        A new list of callbacks.

    Raises:
        ConfigurationError: an unknown name (the message lists the available ones), a
            preset whose package cannot be loaded (with the reason), an argument the preset
            does not take (with the ones it does), or a preset that does not return a list
            of callbacks.

    Example:
        >>> from hookloop import presets
        >>> callbacks = presets.get("finetune", tensorboard=None, progress=False)
        >>> type(callbacks[0]).__name__
        'AMP'
    """
    if not isinstance(name, str):
        raise ConfigurationError(f"A preset name is a string such as 'standard', got {name!r}.")
    usable, problems = _discover()
    entry = usable.get(name)
    if entry is None:
        broken = next((problem for problem in problems if problem.name == name), None)
        if broken is not None:
            raise ConfigurationError(
                f"The preset {name!r} from {broken.package} cannot be used: {broken.problem}.")
        _warn(problems)
        close = difflib.get_close_matches(name, list(usable), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"No preset named {name!r}.{hint} Available: {', '.join(sorted(usable))}. "
            f"Presets of other packages appear here once installed (entry-point group "
            f"{ENTRY_POINT_GROUP!r}); `hookloop presets` lists them.")
    function = entry.function
    assert function is not None
    try:
        inspect.signature(function).bind(**kwargs)
    except TypeError as error:
        raise ConfigurationError(
            f"Preset {name!r} ({entry.package}): {error}. Its parameters: "
            f"{_parameters(function)}.") from None
    except ValueError:  # no signature to check (a builtin or C function): just call it
        pass
    callbacks = function(**kwargs)
    if isinstance(callbacks, tuple):
        callbacks = list(callbacks)
    if not isinstance(callbacks, list) or not all(isinstance(c, Callback) for c in callbacks):
        raise ConfigurationError(
            f"Preset {name!r} ({entry.package}) returned {type(callbacks).__name__} "
            f"{callbacks!r:.200}, not a list of hookloop.Callback instances; that is a bug in "
            "the preset's package.")
    return callbacks


# ------------------------------------------------------------------ helpers
def _parameters(function: Callable[..., Any]) -> str:
    try:
        parameters = inspect.signature(function).parameters.values()
    except ValueError:
        return "unknown"
    return ", ".join(
        parameter.name if parameter.default is inspect.Parameter.empty
        else f"{parameter.name}={parameter.default!r}" for parameter in parameters) or "none"


def _check_count(label: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{label} must be an int >= {minimum}, got {value!r}.")


def _check_positive(label: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigurationError(f"{label} must be a positive number or None, got {value!r}.")


def _schedule_factory(schedule: Any, warmup: int | float) -> Callable[..., Any]:
    """A factory ``fn(optimizer, total_steps)`` for ``LRScheduler`` from a name or a factory."""
    from hookloop import schedules

    if callable(schedule):
        return schedule
    if schedule not in _SCHEDULES:
        raise ConfigurationError(
            f"schedule={schedule!r}: use one of {', '.join(map(repr, _SCHEDULES))}, a factory "
            "fn(optimizer, total_steps) -> scheduler, or None for a constant learning rate.")
    # Checked now, with a made-up length, so a bad warmup fails here and not at fit start.
    if isinstance(warmup, float) or not isinstance(warmup, int) or isinstance(warmup, bool):
        schedules.resolve_warmup(100, warmup)
    elif warmup < 0:
        raise ConfigurationError(f"warmup must be a number of steps >= 0 or a fraction 0 < x < 1, "
                                 f"got {warmup!r}.")
    return functools.partial(getattr(schedules, schedule), warmup_steps=warmup)
