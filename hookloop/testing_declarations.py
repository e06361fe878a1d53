"""The checks of the callback test kit (`hookloop.testing`) on what a callback declares
and on the events it listens to: `check_declarations` and `check_dispatch`. Users import
them from `hookloop.testing`."""

from __future__ import annotations

import os
from collections.abc import Sequence

from hookloop.base.events import Event
from hookloop.callback import Callback
from hookloop.testing_run import (Factory, KitFailure, as_list, folder, make, quiet_fit,
                                  standard_loop)

__all__ = ["check_declarations", "check_dispatch"]


def check_declarations(factory: Factory, directory: str | os.PathLike[str] | None = None) -> None:
    """What the callback declares matches what it does: ``produces(loop)`` names exactly
    the metrics that appear in ``loop.state.metrics``/``history`` with it and not without
    it; ``monitors()`` names metrics that exist; ``runs_after`` and ``conflicts_with``
    name classes or roles that exist.

    Raises:
        KitFailure: a metric written and not declared, declared and not written, or a name
            nothing carries.
    """
    with folder(directory) as root:
        without = standard_loop([], os.path.join(root, "without"), checkpoint=False)
        quiet_fit(without, 2)
        made = make(factory, os.path.join(root, "with"))
        loop = standard_loop(as_list(made), os.path.join(root, "with"), checkpoint=False)
        quiet_fit(loop, 2)
        seen = set(loop.state.metrics)
        for row in loop.state.history:
            seen |= set(row)
        baseline = set(without.state.metrics)
        for row in without.state.history:
            baseline |= set(row)
        written = seen - baseline - {"epoch", "step"}
        declared: set[str] = set()
        for callback in as_list(made):
            declared |= set(callback.produces(loop))
        if written - declared:
            raise KitFailure(f"{as_list(made)!r} writes {sorted(written - declared)} into "
                             f"loop.state.metrics but produces() declares {sorted(declared)}")
        missing = declared - seen
        if missing:
            raise KitFailure(f"{as_list(made)!r} declares produces() {sorted(missing)}, which "
                             f"never appeared (seen: {sorted(seen)})")
        known = _known_names(loop.callbacks)
        for callback in as_list(made):
            for kind in ("runs_after", "conflicts_with"):
                unknown = [name for name in getattr(callback, kind) if name not in known]
                if unknown:
                    raise KitFailure(f"{callback!r}: {kind} names {unknown}, which no class "
                                     "or role of hookloop or of the stack carries: a "
                                     "constraint that never applies (a typo?)")
            for name in callback.monitors():
                if name not in seen:
                    raise KitFailure(f"{callback!r} monitors {name!r}, never produced "
                                     f"(available: {sorted(seen)})")


def _known_names(stack: Sequence[Callback]) -> set[str]:
    import hookloop.callbacks as built_ins

    names = {"stateful"}
    classes = [getattr(built_ins, name) for name in built_ins.__all__]
    for cls in [*classes, *(type(callback) for callback in stack)]:
        if isinstance(cls, type):
            names.update(base.__name__ for base in cls.__mro__)
            names.update(getattr(cls, "roles", ()))
    return names


def check_dispatch(factory: Factory, directory: str | os.PathLike[str] | None = None) -> None:
    """The events the callback does not override are not in the dispatch table (they cost
    nothing per batch), and no event method was set on the instance, where the loop, which
    builds the table from the class, would never call it.

    Raises:
        KitFailure: an event method on the instance, or a table holding a method the class
            does not override.
    """
    from hookloop.engine.dispatch import Table, listens

    with folder(directory) as root:
        callbacks = as_list(make(factory, root))
        table = Table(callbacks, None)
        for callback in callbacks:
            for event in Event:
                name = event.value
                if name in vars(callback):
                    raise KitFailure(f"{callback!r}: {name} is set on the instance; the loop "
                                     "calls only the event methods a class defines: define it "
                                     "in the class")
                listed = any(getattr(handler, "__self__", None) is callback
                             for handler in getattr(table, name))
                # A method the callback's settings make a no-op (`_silent_events`) is left out.
                if listed != listens(callback, name):
                    raise KitFailure(f"{callback!r}: {name} is "
                                     f"{'in' if listed else 'not in'} the dispatch table")
