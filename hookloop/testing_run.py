"""The run of the callback test kit (`hookloop.testing`): a small, fixed fit with the
callback under test in a standard stack, and what the kit's checks compare of it.

A two-layer network with dropout, a shuffled loader, validation data, SGD with momentum:
every random draw and every piece of state shows. The checks live in `hookloop.testing`
(and `hookloop.testing_declarations`, `hookloop.testing_processes`); users import them,
and `standard_loop` and `KitFailure`, from there.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.engine.ordering import overrides

__all__ = ["EPOCHS", "Factory", "KitFailure", "as_list", "folder", "make", "quiet_fit",
           "standard_loop", "stateful", "states", "weights"]

Factory = Callable[..., Callback]
EPOCHS, _BATCHES = 3, 5  # 15 steps


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

    return [GradClip(1.0),
            LRScheduler(lambda optimizer, total: warmup_cosine(optimizer, total, 0.2)),
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


def make(factory: Factory, directory: str) -> Callback:
    """A new instance (or a preset's list) from ``factory``, given ``directory`` when it
    takes one."""
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


def as_list(made: Any) -> list[Callback]:
    """What a factory made, as a list (a preset's stack, or one callback)."""
    return list(made) if isinstance(made, (list, tuple)) else [made]


# ------------------------------------------------------------------ what the checks compare
def weights(loop: Any) -> dict[str, torch.Tensor]:
    """A copy of the model's weights."""
    return {name: tensor.detach().clone() for name, tensor in loop.model.state_dict().items()}


def stateful(callbacks: Sequence[Callback]) -> list[Callback]:
    """The callbacks that have a state of their own (they override ``state_dict``)."""
    return [callback for callback in callbacks if overrides(callback, "state_dict")]


def states(callbacks: Sequence[Callback]) -> dict[str, Any]:
    """The states of the stateful ``callbacks``, by state key."""
    return {callback.state_key: callback.state_dict() for callback in stateful(callbacks)}


def quiet_fit(loop: Any, epochs: int, **options: Any) -> Any:
    """``loop.fit`` with its printing kept from the test's output."""
    with contextlib.redirect_stdout(io.StringIO()):
        return loop.fit(epochs, **options)


# ------------------------------------------------------------------ where the checks write
class folder:
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
