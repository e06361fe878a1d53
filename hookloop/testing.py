"""A test kit for the people who write callbacks and presets: run it in your own test suite.

Each check builds a small, fixed run (a two-layer network with dropout, a shuffled loader,
validation data, SGD with momentum: every random draw and every piece of state shows),
puts the callback under test into a standard stack, and compares against an oracle:

* `check_state`: the callback's state survives ``state_dict``/``load_state_dict``, a
  ``torch.save``/``torch.load(weights_only=True)`` round trip, and a checkpoint file.
* `check_resume`: a fit interrupted at a random step boundary and resumed from its
  checkpoint ends with the weights (``torch.equal``), history and callback state of the
  uninterrupted fit; in process, and with ``relaunch=True`` across a relaunch (the
  interrupted fit runs in a child process, killed with SIGKILL after the step).
* `check_declarations`: ``produces`` names exactly the metrics it writes, ``monitors``
  only metrics that exist, and every ``runs_after`` or ``conflicts_with`` name is a class
  or role that exists (a typo makes a constraint that never applies).
* `check_dispatch`: the events it does not override are not in the dispatch table (they
  cost nothing), and no event method was set on the instance (the loop would never call it).
* `check_ranks` (optional, 2 processes under torchrun on gloo): its decisions (the steps,
  the stop, its state) are the same on every rank.
* `check_callback` runs them all; `check_preset` runs them on a preset's stack.

A failed check raises `KitFailure` (an ``AssertionError``) saying what differed and where.

A callback is given as a factory, ``make(directory) -> Callback`` or ``make() -> Callback``:
each run needs a new instance, and a callback that writes files gets its own folder. For
``relaunch=True`` and `check_ranks` the factory must be importable (a module-level
function), since another process builds it.

Example:
    >>> from hookloop import Callback
    >>> from hookloop.testing import check_callback
    >>> class CountSteps(Callback):
    ...     def __init__(self):
    ...         self.steps = 0
    ...     def after_step(self, loop):
    ...         self.steps += 1
    ...     def state_dict(self):
    ...         return {"steps": self.steps}
    ...     def load_state_dict(self, state):
    ...         self.steps = state["steps"]
    >>> check_callback(CountSteps)
"""

from __future__ import annotations

import io
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from hookloop.base.comparison import difference, without
from hookloop.callback import Callback
from hookloop.engine.stateful import CallbackStates
from hookloop.testing_declarations import check_declarations, check_dispatch
from hookloop.testing_processes import check_ranks, killed_launch
from hookloop.testing_run import (EPOCHS, Factory, KitFailure, as_list, folder, make,
                                  quiet_fit, standard_loop, stateful, states, weights)

__all__ = ["KitFailure", "check_callback", "check_declarations", "check_dispatch",
           "check_preset", "check_ranks", "check_resume", "check_state", "standard_loop"]

# Where users find them, and how errors name them (``hookloop.testing.KitFailure``); their
# code is in the kit's modules below this one, which these checks build on.
for _public in (KitFailure, check_declarations, check_dispatch, check_ranks, standard_loop):
    _public.__module__ = __name__
del _public


# ------------------------------------------------------------------ checks
def check_state(factory: Factory, directory: str | os.PathLike[str] | None = None) -> None:
    """The state survives a checkpoint file: taken mid-run, it loads with
    ``torch.load(weights_only=True)``, and a new instance in a new loop restored from the file
    (a relaunch whose fit has nothing left to train) gives back the same ``state_dict``.

    Raises:
        KitFailure: the state is not in the file, does not load with weights_only, or comes
            back different.
    """
    with folder(directory) as root:
        where = os.path.join(root, "run")
        made = make(factory, os.path.join(root, "first"))
        loop = standard_loop(as_list(made), where)
        quiet_fit(loop, 2, max_steps=7)  # in the middle of an epoch
        own = stateful(as_list(made))
        for callback in own:
            buffer = io.BytesIO()
            torch.save(callback.state_dict(), buffer)
            buffer.seek(0)
            try:
                torch.load(buffer, weights_only=True)
            except Exception as error:  # noqa: BLE001 - reported as the finding
                raise KitFailure(f"{callback!r}: its state_dict() does not load with "
                                 f"torch.load(weights_only=True): {error}") from error
        files = sorted(Path(where, "kit-checkpoints").glob("*epoch=*.pt"))
        if not files:
            raise KitFailure("the kit's Checkpoint wrote no file")
        saved = CallbackStates.saved(torch.load(files[-1], weights_only=True))
        fresh_made = make(factory, os.path.join(root, "first"))  # a relaunch: the same paths
        fresh_loop = standard_loop(as_list(fresh_made), where)
        capture = _Capture(as_list(fresh_made))
        fresh_loop.callbacks.insert(0, capture)  # sees the states restored, before any event
        quiet_fit(fresh_loop, 2, max_steps=7)  # restored from the file; nothing to train
        for callback in own:
            if callback.state_key not in saved:
                raise KitFailure(f"{callback!r}: the checkpoint file {files[-1].name} has no "
                                 f"state under {callback.state_key!r}")
            found = difference(capture.states.get(callback.state_key), saved[callback.state_key])
            if found:
                raise KitFailure(f"{callback!r}: a new instance restored from the checkpoint "
                                 f"file gives a state_dict() after load_state_dict() that "
                                 f"differs from the state in the file: {found}")


class _Capture(Callback):
    """First in the stack: the callbacks' states at fit start, right after the restore."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks, self.states = list(callbacks), dict[str, Any]()

    def on_fit_start(self, loop: Any) -> None:
        self.states = states(self.callbacks)


def check_resume(factory: Factory, directory: str | os.PathLike[str] | None = None, *,
                 seed: int = 0, step: int | None = None, relaunch: bool = False,
                 ignore: Sequence[str] = ()) -> None:
    """A fit stopped at a step boundary and resumed from its checkpoint equals the
    uninterrupted fit: the weights (``torch.equal``), ``loop.state.history`` and the
    callback's final ``state_dict``.

    Args:
        factory: Builds the callback (or, for a preset, the list).
        directory: Where the runs write; None: a temporary folder.
        seed: Seeds the run and the choice of the step.
        step: The step after which the run is interrupted (kept before the run's last
            step); None: two neighbouring steps
            drawn at random from ``seed`` among the run's steps (the last one aside), each
            checked.
        relaunch: Interrupt it in a child process (killed with SIGKILL right after the
            step), and resume in this one. The factory must be importable.
        ignore: Keys (of the history rows and of the callbacks' states) allowed to differ:
            measurements (``"samples_per_s"``), an external run's id (``"run_id"``).

    Raises:
        KitFailure: the resumed run differs, naming what.
    """
    with folder(directory) as root:
        reference_made = make(factory, os.path.join(root, "reference"))
        reference = standard_loop(as_list(reference_made), os.path.join(root, "reference"),
                                  seed=seed)
        quiet_fit(reference, EPOCHS)
        if reference.state.step < 2:
            raise KitFailure(f"the uninterrupted run made {reference.state.step} step(s): "
                             "nothing to interrupt")
        if step is not None:  # kept inside the run (a run that stops early has fewer steps)
            boundaries = [max(1, min(step, reference.state.step - 1))]
        else:  # two neighbours: a bug that depends on where the run stops shows at one
            first_step = random.Random(seed).randrange(1, max(2, reference.state.step - 1))
            boundaries = [first_step, first_step + 1]
        for stop_at in boundaries:
            _resume_once(factory, root, seed, stop_at, relaunch, ignore, reference,
                         reference_made)


def _resume_once(factory: Factory, root: str, seed: int, stop_at: int, relaunch: bool,
                 ignore: Sequence[str], reference: Any, reference_made: Any) -> None:
    where = os.path.join(root, f"resumed-after-{stop_at}")
    if relaunch:
        killed_launch(factory, where, seed, stop_at)
    else:
        first = standard_loop(as_list(make(factory, where)) + [_Interrupt(stop_at)],
                              where, seed=seed)
        try:
            quiet_fit(first, EPOCHS)
        except _Interrupted:
            pass
        else:
            raise KitFailure(f"the run was not interrupted after step {stop_at}")
    made = make(factory, where)
    resumed = standard_loop(as_list(made), where, seed=seed)
    quiet_fit(resumed, EPOCHS)
    how = "relaunched" if relaunch else "resumed"
    checks = [("the weights", weights(resumed), weights(reference)),
              ("loop.state.history", resumed.state.history, reference.state.history),
              ("the step", resumed.state.step, reference.state.step),
              ("the callbacks' state", states(as_list(made)), states(as_list(reference_made)))]
    for what, got, expected in checks:
        found = difference(without(got, ignore), without(expected, ignore))
        if found:
            raise KitFailure(
                f"{as_list(made)!r}: a run stopped after step {stop_at} and {how} from its "
                f"checkpoint differs from the uninterrupted run in {what}: {found}")


class _Interrupted(Exception):
    """The kit's interruption of a run (a crash after a completed step)."""


class _Interrupt(Callback):
    """Raise right after optimizer step ``step`` (its checkpoint is written by then)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, loop: Any) -> None:
        if loop.state.step == self.step and loop.optimizer_stepped:
            raise _Interrupted(f"the kit interrupts the run after step {self.step}")


def check_callback(factory: Factory, directory: str | os.PathLike[str] | None = None, *,
                   seed: int = 0, step: int | None = None, relaunch: bool = False,
                   ranks: bool = False, ignore: Sequence[str] = ()) -> None:
    """Every check of the kit on one callback: `check_dispatch`, `check_declarations`,
    `check_state`, `check_resume` (in process, and across a relaunch with
    ``relaunch=True``; ``step`` and ``ignore`` as there) and, with ``ranks=True``,
    `check_ranks`.

    Raises:
        KitFailure: the first check that fails.
    """
    with folder(directory) as root:
        check_dispatch(factory, os.path.join(root, "dispatch"))
        check_declarations(factory, os.path.join(root, "declarations"))
        check_state(factory, os.path.join(root, "state"))
        check_resume(factory, os.path.join(root, "resume"), seed=seed, step=step, ignore=ignore)
        if relaunch:
            check_resume(factory, os.path.join(root, "relaunch"), seed=seed, step=step,
                         relaunch=True, ignore=ignore)
        if ranks:
            check_ranks(factory, os.path.join(root, "two-ranks"))


def check_preset(name: str, *, seed: int = 0, relaunch: bool = False,
                 **arguments: Any) -> None:
    """The kit on a preset: ``presets.get(name, **arguments)`` builds the stack (its own
    checkpoint callbacks are replaced by the kit's), then `check_dispatch`,
    `check_declarations`, `check_state` and `check_resume` run on it. Its files go to a
    temporary folder (the working directory during the check).

    Raises:
        KitFailure: the first check that fails; ConfigurationError: a preset that cannot
            be built (not installed, outside its hookloop range).
    """
    from hookloop import presets

    presets.get(name, **arguments)  # refused now, by name, when it cannot be used
    factory = cast(Factory, _PresetFactory(name, arguments))  # the kit takes a stack's too
    with folder(None) as root:
        previous = os.getcwd()
        os.chdir(root)
        try:
            check_callback(factory, os.path.join(root, "kit"), seed=seed, relaunch=relaunch)
        finally:
            os.chdir(previous)


class _PresetFactory:
    """A preset's stack as a factory, without the preset's own checkpoints."""

    def __init__(self, name: str, arguments: dict[str, Any]) -> None:
        self.name, self.arguments = name, arguments
        self.__module__, self.__qualname__ = "__main__", f"<preset {name}>"

    def __call__(self) -> list[Callback]:
        from hookloop import presets
        from hookloop.callbacks import Checkpoint

        return [callback for callback in presets.get(self.name, **self.arguments)
                if not isinstance(callback, Checkpoint)]

    def __repr__(self) -> str:
        return f"presets.get({self.name!r})"
