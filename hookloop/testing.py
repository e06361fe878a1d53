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

import inspect
import io
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from hookloop.base.comparison import difference, without
from hookloop.base.events import Event
from hookloop.callback import Callback
from hookloop.engine.ordering import overrides
from hookloop.engine.stateful import CallbackStates

__all__ = ["KitFailure", "check_callback", "check_declarations", "check_dispatch",
           "check_preset", "check_ranks", "check_resume", "check_state", "standard_loop"]

Factory = Callable[..., Callback]
_EPOCHS, _BATCHES = 3, 5  # 15 steps


class KitFailure(AssertionError):
    """A check of `hookloop.testing` failed: the message says which and what differed."""


# ------------------------------------------------------------------ the run
def _data(seed: int) -> tuple[Any, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(seed + 1)
    inputs = torch.randn(_BATCHES * 4 + 8, 6, generator=generator)
    targets = torch.randint(0, 3, (len(inputs),), generator=generator)
    train = DataLoader(TensorDataset(inputs[:-8], targets[:-8]), batch_size=4, shuffle=True,
                       generator=torch.Generator().manual_seed(seed + 2))
    val = DataLoader(TensorDataset(inputs[-8:], targets[-8:]), batch_size=4)
    return train, val


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=-1) == targets).float().mean()


def _standard_stack(directory: str) -> list[Callback]:
    from hookloop.callbacks import GradClip, LRScheduler, Metrics
    from hookloop.schedules import warmup_cosine

    return [GradClip(1.0), LRScheduler(lambda optimizer, total: warmup_cosine(optimizer, total, 0.2)),
            Metrics(acc=_accuracy)]


def _checkpoint(directory: str) -> Callback:
    from hookloop.callbacks import Checkpoint

    return Checkpoint(os.path.join(directory, "kit-checkpoints"), every_n_steps=1,
                      resume=True, name="hookloop-kit")


def _placed(callbacks: Sequence[Callback], stack: list[Callback], loop: Any) -> list[Callback]:
    """``callbacks`` inserted into ``stack`` at the first position the order rules accept
    (the checkpoint stays last)."""
    from hookloop.engine.ordering import check_callbacks
    from hookloop import CallbackOrderError  # the public name, as for Loop

    error: Exception | None = None
    for position in range(len(stack), -1, -1):
        candidate = stack[:position] + list(callbacks) + stack[position:]
        try:
            check_callbacks(candidate, loop, loop.val_data)
        except CallbackOrderError as problem:
            error = error or problem
            continue
        return candidate
    raise KitFailure(f"no position in the kit's standard stack suits {list(callbacks)!r}: "
                     f"{error}")


def standard_loop(callbacks: Sequence[Callback] | Callback, directory: str | os.PathLike[str],
                  *, seed: int = 0, checkpoint: bool = True, stack: bool = True) -> Any:
    """The kit's run: ``callbacks`` in a standard stack (GradClip, a warmup-cosine schedule,
    Metrics with ``val_acc``, and a `Checkpoint` every step in ``directory``), over a
    dropout network and shuffled data seeded with ``seed``.

    Example:
        >>> import tempfile
        >>> loop = standard_loop([], tempfile.mkdtemp(), checkpoint=False)
        >>> [type(callback).__name__ for callback in loop.callbacks]
        ['GradClip', 'LRScheduler', 'Metrics']
    """
    from hookloop import Loop  # the public API, as the kit's users write it

    if isinstance(callbacks, Callback):
        callbacks = [callbacks]
    directory = os.fspath(directory)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 3))
    train, val = _data(seed)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), train,
                val_data=val, loss_fn=torch.nn.functional.cross_entropy, device="cpu")
    kinds = {type(callback) for callback in callbacks}
    # The author's own GradClip, scheduler or Metrics takes the place of the kit's.
    base = [c for c in _standard_stack(directory) if type(c) not in kinds] if stack else []
    placed = _placed(callbacks, base, loop) if base else list(callbacks)
    loop.callbacks = placed + ([_checkpoint(directory)] if checkpoint else [])
    return loop


def _make(factory: Factory, directory: str) -> Callback:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        parameters = inspect.Signature().parameters  # none
    required = [p for p in parameters.values() if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    os.makedirs(directory, exist_ok=True)
    made = factory(Path(directory)) if required else factory()
    callbacks = made if isinstance(made, (list, tuple)) else [made]
    if not all(isinstance(callback, Callback) for callback in callbacks):
        raise KitFailure(f"the factory {factory!r} returned {made!r}, not a Callback (or a "
                         "list of them, for a preset)")
    return made


def _as_list(made: Any) -> list[Callback]:
    return list(made) if isinstance(made, (list, tuple)) else [made]


# ------------------------------------------------------------------ comparisons
def _weights(loop: Any) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in loop.model.state_dict().items()}


def _states(callbacks: Sequence[Callback]) -> dict[str, Any]:
    return {callback.state_key: callback.state_dict() for callback in callbacks
            if overrides(callback, "state_dict")}


def _quiet_fit(loop: Any, epochs: int, **options: Any) -> Any:
    import contextlib

    with contextlib.redirect_stdout(io.StringIO()):
        return loop.fit(epochs, **options)


# ------------------------------------------------------------------ checks
def check_state(factory: Factory, directory: str | os.PathLike[str] | None = None) -> None:
    """The state survives a checkpoint file: taken mid-run, it loads with
    ``torch.load(weights_only=True)``, and a new instance in a new loop restored from the file
    (a relaunch whose fit has nothing left to train) gives back the same ``state_dict``.

    Raises:
        KitFailure: the state is not in the file, does not load with weights_only, or comes
            back different.
    """
    with _folder(directory) as root:
        where = os.path.join(root, "run")
        made = _make(factory, os.path.join(root, "first"))
        loop = standard_loop(_as_list(made), where)
        _quiet_fit(loop, 2, max_steps=7)  # in the middle of an epoch
        stateful = [callback for callback in _as_list(made) if overrides(callback, "state_dict")]
        for callback in stateful:
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
        fresh_made = _make(factory, os.path.join(root, "first"))  # a relaunch: the same paths
        fresh_loop = standard_loop(_as_list(fresh_made), where)
        capture = _Capture(_as_list(fresh_made))
        fresh_loop.callbacks.insert(0, capture)  # sees the states restored, before any event
        _quiet_fit(fresh_loop, 2, max_steps=7)  # restored from the file; nothing to train
        for callback in stateful:
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
        self.states = _states(self.callbacks)


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
    with _folder(directory) as root:
        reference_made = _make(factory, os.path.join(root, "reference"))
        reference = standard_loop(_as_list(reference_made), os.path.join(root, "reference"),
                                  seed=seed)
        _quiet_fit(reference, _EPOCHS)
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
        _killed_launch(factory, where, seed, stop_at)
    else:
        first = standard_loop(_as_list(_make(factory, where)) + [_Interrupt(stop_at)],
                              where, seed=seed)
        try:
            _quiet_fit(first, _EPOCHS)
        except _Interrupted:
            pass
        else:
            raise KitFailure(f"the run was not interrupted after step {stop_at}")
    made = _make(factory, where)
    resumed = standard_loop(_as_list(made), where, seed=seed)
    _quiet_fit(resumed, _EPOCHS)
    how = "relaunched" if relaunch else "resumed"
    checks = [("the weights", _weights(resumed), _weights(reference)),
              ("loop.state.history", resumed.state.history, reference.state.history),
              ("the step", resumed.state.step, reference.state.step),
              ("the callbacks' state", _states(_as_list(made)), _states(_as_list(reference_made)))]
    for what, got, expected in checks:
        found = difference(without(got, ignore), without(expected, ignore))
        if found:
            raise KitFailure(
                f"{_as_list(made)!r}: a run stopped after step {stop_at} and {how} from its "
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


_CHILD = r'''
import importlib, os, signal, sys
sys.path[:0] = {path}
from hookloop import Callback, testing
module = importlib.import_module({module!r})
factory = module
for part in {qualname!r}.split("."):
    factory = getattr(factory, part)
stop_at = {stop_at}

class Kill(Callback):
    def on_batch_end(self, loop):
        if loop.state.step == stop_at and loop.optimizer_stepped:
            os.kill(os.getpid(), signal.SIGKILL)

made = testing._make(factory, {where!r})
loop = testing.standard_loop(testing._as_list(made), {where!r}, seed={seed})
loop.callbacks.append(Kill())  # after the checkpoint of the step: killed once it is written
testing._quiet_fit(loop, {epochs})
'''


def _importable(factory: Factory) -> tuple[str, str]:
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or "<" in qualname or module == "__main__":
        raise KitFailure(f"{factory!r} must be a module-level function or class (another "
                         "process imports it) for relaunch=True and check_ranks")
    return module, qualname


def _child_environment() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *sys.path])
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _killed_launch(factory: Factory, where: str, seed: int, stop_at: int) -> None:
    module, qualname = _importable(factory)
    script = _CHILD.format(path=json.dumps([p for p in sys.path if p]), module=module,
                           qualname=qualname, stop_at=stop_at, where=where, seed=seed,
                           epochs=_EPOCHS)
    result = subprocess.run([sys.executable, "-c", "import torch; torch.set_num_threads(1)\n"
                             + script], env=_child_environment(), capture_output=True,
                            text=True, timeout=600)
    if result.returncode != -9:
        raise KitFailure(f"the interrupted launch should have been killed after step "
                         f"{stop_at}; it exited with {result.returncode}:\n"
                         f"{result.stderr[-3000:]}")


def check_declarations(factory: Factory, directory: str | os.PathLike[str] | None = None) -> None:
    """What the callback declares matches what it does: ``produces(loop)`` names exactly
    the metrics that appear in ``loop.state.metrics``/``history`` with it and not without
    it; ``monitors()`` names metrics that exist; ``runs_after`` and ``conflicts_with``
    name classes or roles that exist.

    Raises:
        KitFailure: a metric written and not declared, declared and not written, or a name
            nothing carries.
    """
    with _folder(directory) as root:
        without = standard_loop([], os.path.join(root, "without"), checkpoint=False)
        _quiet_fit(without, 2)
        made = _make(factory, os.path.join(root, "with"))
        loop = standard_loop(_as_list(made), os.path.join(root, "with"), checkpoint=False)
        _quiet_fit(loop, 2)
        seen = set(loop.state.metrics)
        for row in loop.state.history:
            seen |= set(row)
        baseline = set(without.state.metrics)
        for row in without.state.history:
            baseline |= set(row)
        written = seen - baseline - {"epoch", "step"}
        declared: set[str] = set()
        for callback in _as_list(made):
            declared |= set(callback.produces(loop))
        if written - declared:
            raise KitFailure(f"{_as_list(made)!r} writes {sorted(written - declared)} into "
                             f"loop.state.metrics but produces() declares {sorted(declared)}")
        missing = declared - seen
        if missing:
            raise KitFailure(f"{_as_list(made)!r} declares produces() {sorted(missing)}, which "
                             f"never appeared (seen: {sorted(seen)})")
        known = _known_names(loop.callbacks)
        for callback in _as_list(made):
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

    with _folder(directory) as root:
        callbacks = _as_list(_make(factory, root))
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


def check_ranks(factory: Factory, directory: str | os.PathLike[str] | None = None, *,
                timeout: float = 300) -> None:
    """Under torchrun with 2 processes (gloo, CPU): every rank makes the same decisions
    with the callback in the standard stack under `DDP`: the same weights, steps, stop
    (and its reason), ``loop.state.metrics`` and callback state.

    Raises:
        KitFailure: the ranks disagree (naming the first difference), or a rank failed.
    """
    module, qualname = _importable(factory)
    with _folder(directory) as root:
        script = Path(root, "ranks.py")
        script.write_text(_RANKS.format(path=json.dumps([p for p in sys.path if p]),
                                        module=module, qualname=qualname, root=root),
                          encoding="utf-8")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=2", str(script)]
        env = _child_environment()
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as error:
            # torchrun starts each rank in a session of its own: only torchrun can end them
            # (SIGTERM, then SIGKILL after its grace), so a SIGKILL to it would orphan them.
            process.terminate()
            process.communicate()
            raise KitFailure(f"the 2 ranks did not finish in {timeout} s (a hang: a "
                             "decision one rank made alone?)") from error
        if process.returncode != 0:
            raise KitFailure("a rank failed under torchrun (ranks that decide differently "
                             f"break the collectives):\n{output[-3000:]}")
        ranks = [torch.load(Path(root, f"rank{rank}.pt"), weights_only=True) for rank in (0, 1)]
        found = difference(ranks[1], ranks[0])
        if found:
            raise KitFailure(f"rank 1 decided differently from rank 0: {found}")


_RANKS = r'''
import contextlib, importlib, io, os, sys
sys.path[:0] = {path}
import torch
torch.set_num_threads(1)
from hookloop import testing
from hookloop.callbacks import DDP
module = importlib.import_module({module!r})
factory = module
for part in {qualname!r}.split("."):
    factory = getattr(factory, part)
rank = int(os.environ["RANK"])
made = testing._make(factory, os.path.join({root!r}, f"work{{rank}}"))
loop = testing.standard_loop([DDP()] + testing._as_list(made), os.path.join({root!r}, f"work{{rank}}"),
                             checkpoint=False)
with contextlib.redirect_stdout(io.StringIO()):
    loop.fit(3)
own = [c for c in testing._as_list(made) if not c.rank_zero_only]
torch.save({{"weights": testing._weights(loop), "step": loop.state.step, "stopped": loop.stop_requested,
             "reason": loop.stop_reason or "", "epoch": loop.state.epoch,
             "metrics": {{k: float(v) for k, v in loop.state.metrics.items()}},
             "state": testing._states(own)}}, os.path.join({root!r}, f"rank{{rank}}.pt"))
'''


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
    with _folder(directory) as root:
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
    with _folder(None) as root:
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


class _folder:
    """A given folder, or a temporary one removed afterwards."""

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self._given = None if directory is None else os.fspath(directory)
        self._temporary: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> str:
        if self._given is not None:
            os.makedirs(self._given, exist_ok=True)
            return self._given
        self._temporary = tempfile.TemporaryDirectory(prefix="hookloop-kit-")
        return self._temporary.name

    def __exit__(self, *exc: Any) -> None:
        if self._temporary is not None:
            self._temporary.cleanup()
