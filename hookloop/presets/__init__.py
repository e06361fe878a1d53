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
every preset installed, and `get` builds one by name (both live in `hookloop.presets.registry`,
which says when another package is imported; the built-ins' code is in
`hookloop.presets.builtin`). Presets are only ever used when asked for by
name: installing a package never changes a stack you did not ask it to build.
`DetectAnomaly` and `ShortRun`, the debug preset's own callbacks, live in
`hookloop.callbacks`; ``presets.DetectAnomaly`` and ``presets.ShortRun`` are the same classes.
"""

from __future__ import annotations

from hookloop.callback import Callback
from hookloop.callbacks.detect_anomaly import DetectAnomaly
from hookloop.callbacks.short_run import ShortRun
from hookloop.errors import ConfigurationError
from hookloop.presets.builtin import debug, finetune, standard
from hookloop.presets.registry import ENTRY_POINT_GROUP, available, get, requires

__all__ = [
    "ENTRY_POINT_GROUP",
    "DetectAnomaly",
    "ShortRun",
    "available",
    "debug",
    "finetune",
    "get",
    "replace",
    "requires",
    "standard",
]


# Where users find them, and how errors name them (``presets.standard``); their code is in
# hookloop.presets.builtin so that the registry, which this module re-exports, can reach it.
for _built_in in (standard, finetune, debug):
    _built_in.__module__ = __name__
del _built_in


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
