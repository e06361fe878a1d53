"""The test suite's shared builders: tiny models, data, loops, and the recorder callbacks.

Every test file builds its runs from these, so a setup is written once. Where a test depends
on exact numbers (seeds, sizes, learning rates), it passes them as arguments: the builders
draw random numbers in the order the arguments say (model, then training data, then
validation data), so the same call always gives the same run.

Usage (no ``>>>`` prompts: pytest collects this module's docstrings as doctests)::

    from builders import BatchCounter, make_loop, regression_batches, sgd, two_layers

    counter = BatchCounter()
    loop = make_loop([counter], model=lambda: two_layers(3, 8, 1, nn.ReLU()),
                     train=lambda: regression_batches(4), val=slice(1),
                     optimizer=sgd(0.05, momentum=0.9))
    loop.fit(2)
    assert counter.batches == 8
"""

from __future__ import annotations

import copy
import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Event, Loop

__all__ = [
    "MLP",
    "BatchCounter",
    "Crash",
    "DrawnBoundary",
    "EventRecorder",
    "Net",
    "RaiseAfterStep",
    "RaiseAtBatch",
    "ScriptedMetric",
    "SeenSamples",
    "Signal",
    "StateCapture",
    "StopAt",
    "StepRecorder",
    "Unsized",
    "ValidationSteps",
    "WeightRecorder",
    "accuracy",
    "adam",
    "assert_close_weights",
    "adamw",
    "classification_batches",
    "classification_dataset",
    "dropout_loop",
    "make_loop",
    "net_batches",
    "net_loop",
    "regression_batches",
    "regression_dataset",
    "same_weights",
    "sgd",
    "shuffled",
    "shuffled_run",
    "split",
    "two_layers",
    "weights",
]

T = TypeVar("T")
Batch = tuple[torch.Tensor, torch.Tensor]
#: A value, or a function of no arguments that builds it (called after seeding).
Build = Union[T, Callable[[], T]]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


# ------------------------------------------------------------------------------- data
def regression_batches(count: int, *, size: int = 4, features: int = 3, outputs: int = 1,
                       seed: int | None = None) -> list[Batch]:
    """``count`` batches of (``randn(size, features)``, ``randn(size, outputs)``).

    Args:
        count: Number of batches.
        size: Samples per batch.
        features: Input width.
        outputs: Target width.
        seed: Seed of a generator of their own; None draws from torch's global generator
            (so the batches depend on what was drawn before, as in a script).

    Returns:
        The batches, inputs and targets drawn in turn.
    """
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return [(torch.randn(size, features, generator=generator),
             torch.randn(size, outputs, generator=generator)) for _ in range(count)]


def classification_batches(count: int, *, size: int = 4, features: int = 5, classes: int = 3,
                           seed: int | None = None) -> list[Batch]:
    """``count`` batches of (``randn(size, features)``, labels in ``[0, classes)``).

    Args:
        count: Number of batches.
        size: Samples per batch.
        features: Input width.
        classes: Number of classes of the labels.
        seed: Seed of a generator of their own; None draws from torch's global generator.

    Returns:
        The batches, inputs and labels drawn in turn.
    """
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return [(torch.randn(size, features, generator=generator),
             torch.randint(0, classes, (size,), generator=generator)) for _ in range(count)]


def regression_dataset(samples: int, *, features: int = 3, outputs: int = 1,
                       seed: int = 0) -> TensorDataset:
    """A dataset of ``randn(samples, features)`` inputs and ``randn(samples, outputs)`` targets.

    Args:
        samples: Number of samples.
        features: Input width.
        outputs: Target width.
        seed: Seed of the dataset's own generator (inputs drawn first).

    Returns:
        The dataset.
    """
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, features, generator=generator),
                         torch.randn(samples, outputs, generator=generator))


def classification_dataset(samples: int, *, features: int = 6, classes: int = 3,
                           seed: int = 1) -> TensorDataset:
    """A dataset of ``randn(samples, features)`` inputs and labels in ``[0, classes)``.

    Args:
        samples: Number of samples.
        features: Input width.
        classes: Number of classes of the labels.
        seed: Seed of the dataset's own generator (inputs drawn first).

    Returns:
        The dataset.
    """
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, features, generator=generator),
                         torch.randint(0, classes, (samples,), generator=generator))


def split(dataset: TensorDataset, count: int) -> tuple[TensorDataset, TensorDataset]:
    """The first ``count`` samples of a tensor dataset, and the rest.

    Args:
        dataset: The dataset to cut.
        count: Samples in the first part.

    Returns:
        The two datasets, sharing the tensors' storage.
    """
    return (TensorDataset(*(tensor[:count] for tensor in dataset.tensors)),
            TensorDataset(*(tensor[count:] for tensor in dataset.tensors)))


def shuffled(dataset: Any, batch_size: int, seed: int) -> DataLoader:
    """A shuffling DataLoader with a generator of its own, so its order is reproducible.

    Args:
        dataset: The dataset.
        batch_size: Samples per batch.
        seed: Seed of the loader's generator.

    Returns:
        The loader.
    """
    return DataLoader(dataset, batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


class Unsized:
    """Batches iterable again every epoch, without ``__len__`` (a stream, an IterableDataset).

    Args:
        batches: The batches each iteration yields, in order.
    """

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The share of samples whose largest output is the target class.

    Args:
        outputs: Scores of shape (batch, classes).
        targets: Class indices of shape (batch,).

    Returns:
        A 0-d float tensor.
    """
    return (outputs.argmax(dim=-1) == targets).float().mean()


# ----------------------------------------------------------------------------- models
def two_layers(inputs: int, hidden: int, outputs: int, *between: nn.Module) -> nn.Sequential:
    """``Sequential(Linear(inputs, hidden), *between, Linear(hidden, outputs))``.

    The two Linear layers draw their initial weights from torch's global generator, first
    one first; the modules between them (activations, dropout, batch norm) draw nothing, so
    the weights are those of the same Sequential written out by hand.

    Args:
        inputs: Input width.
        hidden: Width between the layers.
        outputs: Output width.
        *between: Modules between the two layers, in order (``nn.ReLU()``, ...).

    Returns:
        The model.
    """
    return nn.Sequential(nn.Linear(inputs, hidden), *between, nn.Linear(hidden, outputs))


class MLP(nn.Module):
    """The loop tests' classifier: 6 features, 16 hidden units, 3 classes, under ``.net``.

    Args:
        features: Input width.
        classes: Number of outputs.
    """

    def __init__(self, features: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Net(nn.Module):
    """The across-launch tests' regression net: 4 features, dropout, optional batch norm.

    Args:
        batch_norm: Put a BatchNorm1d after the first layer (its running statistics are
            state a resume must bring back).
    """

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        if batch_norm:
            self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        if hasattr(self, "bn"):
            hidden = self.bn(hidden)
        return self.fc2(self.drop(torch.relu(hidden)))


# ------------------------------------------------------------------------- optimizers
def sgd(lr: float = 0.1, **options: Any) -> OptimizerFactory:
    """An SGD factory for `make_loop` (``momentum=`` and the rest pass through)."""
    return functools.partial(torch.optim.SGD, lr=lr, **options)


def adam(lr: float, **options: Any) -> OptimizerFactory:
    """An Adam factory for `make_loop`."""
    return functools.partial(torch.optim.Adam, lr=lr, **options)


def adamw(lr: float, **options: Any) -> OptimizerFactory:
    """An AdamW factory for `make_loop`."""
    return functools.partial(torch.optim.AdamW, lr=lr, **options)


# ------------------------------------------------------------------------------ loops
def _built(value: Any) -> Any:
    return value() if callable(value) and not isinstance(value, nn.Module) else value


def make_loop(callbacks: Iterable[Callback] = (), *,
              model: Build[nn.Module] = lambda: nn.Linear(3, 1),
              train: Build[Any] = lambda: regression_batches(4),
              val: Any = None,
              optimizer: OptimizerFactory = sgd(0.1),
              loss_fn: Callable[[Any, Any], torch.Tensor] | None = F.mse_loss,
              seed: int | None = 0,
              device: str = "cpu",
              **options: Any) -> Loop:
    """A `Loop` over a tiny model and data, built in a fixed order from a fixed seed.

    After ``torch.manual_seed(seed)`` (skipped when ``seed`` is None), the model is built,
    then the training data, then the validation data: the order a script would follow, so
    a factory drawing from the global generator always sees the same state.

    Args:
        callbacks: The stack, in order.
        model: A module, or a factory building it after seeding.
        train: Training data, or a factory building it after the model.
        val: None, validation data, a ``slice`` of the (built) training data, or a function
            of the built training data returning the validation data (``lambda train:
            train`` validates on the training list itself).
        optimizer: A function of the model's parameters returning the optimizer
            (`sgd`, `adam`, `adamw`).
        loss_fn: The loss function, or None (a mapping batch, or ``forward=``).
        seed: Seed of torch's global generator before anything is built; None leaves it.
        device: The loop's device.
        **options: Other `Loop` arguments (``val_every_n_steps=``, ``forward=``, ...).

    Returns:
        The loop, not fitted yet.
    """
    if seed is not None:
        torch.manual_seed(seed)
    module = _built(model)
    train_data = _built(train)
    if isinstance(val, slice):
        val_data = train_data[val]
    elif callable(val):
        val_data = val(train_data)
    else:
        val_data = val
    return Loop(module, optimizer(module.parameters()), train_data, val_data=val_data,
                loss_fn=loss_fn, callbacks=list(callbacks), device=device, **options)


def dropout_loop(callbacks: Iterable[Callback] = (), *, batches: int = 4,
                 **options: Any) -> Loop:
    """A regression run in which any stray random draw shows: dropout and a shuffled loader.

    ``batches`` batches of 4 samples (3 features) drawn from the global generator after the
    model, shuffled by a loader seeded 7; validation on the first 8 samples; SGD lr 0.05.

    Args:
        callbacks: The stack, in order.
        batches: Training batches per epoch.
        **options: Other `Loop` arguments (``val_every_n_steps=``, ...).

    Returns:
        The loop, not fitted yet.
    """
    def train() -> DataLoader:
        dataset = TensorDataset(torch.randn(4 * batches, 3), torch.randn(4 * batches, 1))
        return shuffled(dataset, 4, seed=7)

    return make_loop(callbacks, model=lambda: two_layers(3, 8, 1, nn.Dropout(0.3)), train=train,
                     val=lambda loader: DataLoader(split(loader.dataset, 8)[0], batch_size=4),
                     optimizer=sgd(0.05), **options)


def shuffled_run(callbacks: Iterable[Callback] = (), samples: int = 96,
                 batch: int = 8) -> tuple[nn.Module, Loop]:
    """A classification run with dropout over a shuffled loader: 6 features, 3 classes.

    The dataset is drawn from a generator seeded 3 and shuffled by one seeded 4; the model
    (``two_layers(6, 16, 3, Dropout(0.3), ReLU())``) is seeded 0; SGD lr 0.1, momentum 0.9.

    Args:
        callbacks: The stack, in order.
        samples: Samples in the dataset.
        batch: Samples per batch.

    Returns:
        The model and the loop, not fitted yet.
    """
    loader = shuffled(classification_dataset(samples, features=6, classes=3, seed=3), batch,
                      seed=4)
    loop = make_loop(callbacks, model=lambda: two_layers(6, 16, 3, nn.Dropout(0.3), nn.ReLU()),
                     train=loader, optimizer=sgd(0.1, momentum=0.9), loss_fn=F.cross_entropy)
    return loop.model, loop


def net_batches(count: int = 4, *, size: int = 4, seed: int = 1) -> list[Batch]:
    """The across-launch tests' data: batches of 4 features and 1 target (seeded)."""
    return regression_batches(count, size=size, features=4, seed=seed)


def net_loop(callbacks: Iterable[Callback] = (), *, batch_norm: bool = False, train: Any = None,
             val: Any = None, lr: float = 0.05, seed: int = 0, **options: Any) -> Loop:
    """The across-launch tests' run: `Net`, SGD with momentum 0.9, `net_batches` to train on.

    Args:
        callbacks: The stack, in order.
        batch_norm: Give the net a BatchNorm1d.
        train: Training data; None trains on ``net_batches()``.
        val: Validation data, or None.
        lr: The learning rate.
        seed: Seed of the model's weights (and of the global generator dropout draws from).
        **options: Other `Loop` arguments.

    Returns:
        The loop, not fitted yet.
    """
    return make_loop(callbacks, model=lambda: Net(batch_norm),
                     train=lambda: net_batches() if train is None else train, val=val,
                     optimizer=sgd(lr, momentum=0.9), seed=seed, **options)


# ---------------------------------------------------------------------------- weights
def weights(source: Loop | nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of a model's state dict (a loop's unwrapped model, or a module)."""
    module = source.unwrapped_model if isinstance(source, Loop) else source
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def assert_close_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         atol: float = 1e-5) -> None:
    """Two state dicts with the same names and values within ``atol``, name by name."""
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol, msg=key)


def same_weights(first: Loop | nn.Module | dict[str, torch.Tensor],
                 second: Loop | nn.Module | dict[str, torch.Tensor]) -> bool:
    """True if both hold the same names with bitwise equal tensors (`torch.equal`)."""
    first = first if isinstance(first, dict) else weights(first)
    second = second if isinstance(second, dict) else weights(second)
    return first.keys() == second.keys() and all(torch.equal(first[name], second[name])
                                                  for name in first)


# ------------------------------------------------------------------ recorder callbacks
class EventRecorder(Callback):
    """Records every event with the counters the loop shows at that moment: the ground truth.

    Each event is recorded as ``(name, epoch, batch_idx, step)``; ``on_exception`` as
    ``("on_exception", exception class name)``.

    Args:
        fail_at: ``(event, epoch, batch_idx)`` at which to raise ``exc("boom")``.
        exc: The exception class raised at ``fail_at``.
    """

    def __init__(self, fail_at: tuple[str, int, int] | None = None,
                 exc: type[BaseException] = RuntimeError) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.fail_at = fail_at
        self.exc = exc

    def _record(self, name: str, loop: Loop) -> None:
        state = loop.state
        self.events.append((name, state.epoch, state.batch_idx, state.step))
        if self.fail_at == (name, state.epoch, state.batch_idx):
            raise self.exc("boom")

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        self.events.append(("on_exception", type(exc).__name__))

    def labels(self, *names: str) -> list[str]:
        """The recorded events among ``names`` (all if none), ``on_exception:<class>`` too."""
        return [f"{event[0]}:{event[1]}" if event[0] == "on_exception" else event[0]
                for event in self.events if not names or event[0] in names]


def _record_event(name: str) -> Callable[[EventRecorder, Loop], None]:
    def method(self: EventRecorder, loop: Loop) -> None:
        self._record(name, loop)

    method.__name__ = name
    return method


for _event in Event:
    if _event is not Event.ON_EXCEPTION:
        setattr(EventRecorder, _event.value, _record_event(_event.value))


class BatchCounter(Callback):
    """Counts training batches started: proves an error came before the first one.

    Args:
        validation: Count validation batches too (the sanity check's included).
    """

    def __init__(self, validation: bool = False) -> None:
        self.batches = 0
        self.validation = validation

    def on_batch_start(self, loop: Loop) -> None:
        self.batches += 1

    def on_validation_batch_start(self, loop: Loop) -> None:
        if self.validation:
            self.batches += 1


def _state_copy(loop: Loop, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() if dtype is None else value.detach().clone().to(dtype)
            for name, value in loop.model.state_dict().items()}


class WeightRecorder(Callback):
    """The model's state dict after every real optimizer step, keyed by the step.

    Args:
        dtype: Convert the copies (``torch.float64`` for a hand computation in double).
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.dtype = dtype

    def after_step(self, loop: Loop) -> None:
        self.after[loop.state.step] = _state_copy(loop, self.dtype)


class ScriptedMetric(Callback):
    """Writes scripted values as a metric at each validation (the sanity check's aside).

    Args:
        values: The values, in the order ``by`` picks them.
        name: The metric written.
        by: ``"epoch"``: ``values[epoch]``; ``"history"``: ``values[len(history)]``, the
            number of rows so far; ``"order"``: the next value at each validation.
        at_sanity: The value written during the sanity check; None writes nothing then.
        weights_by: ``"epoch"`` or ``"step"``: keep the weights validated in ``weights_at``
            under that key; None keeps nothing.
    """

    def __init__(self, values: Iterable[float], name: str = "val_score", *, by: str = "epoch",
                 at_sanity: float | None = None, weights_by: str | None = None) -> None:
        self.values = list(values)
        self.name, self.by, self.at_sanity, self.weights_by = name, by, at_sanity, weights_by
        self._next = iter(self.values)
        self.weights_at: dict[int, dict[str, torch.Tensor]] = {}

    def produces(self, loop: Loop) -> list[str]:
        return [self.name]

    def on_validation_end(self, loop: Loop) -> None:
        if loop.sanity_checking:
            if self.at_sanity is not None:
                loop.state.metrics[self.name] = self.at_sanity
            return
        if self.by == "epoch":
            value = self.values[loop.state.epoch]
        elif self.by == "history":
            value = self.values[len(loop.state.history)]
        else:
            value = next(self._next)
        loop.state.metrics[self.name] = value
        if self.weights_by is not None:
            key = loop.state.epoch if self.weights_by == "epoch" else loop.state.step
            self.weights_at[key] = _state_copy(loop)


class StepRecorder(Callback):
    """Ground truth of every step (loss, learning rate, grad norm) and of every validation.

    Reads the values with ``.item()`` at each step: a test may sync, the loop may not.
    """

    def __init__(self) -> None:
        self.loss: dict[int, float] = {}
        self.lr: dict[int, float] = {}
        self.grad_norm: dict[int, float] = {}
        self.validations: list[tuple[int, dict[str, float]]] = []

    def after_step(self, loop: Loop) -> None:
        step = loop.state.step
        self.loss[step] = loop.state.loss.item()
        self.lr[step] = loop.optimizer.param_groups[0]["lr"]
        if loop.state.grad_norm is not None:
            self.grad_norm[step] = loop.state.grad_norm.item()

    def on_validation_end(self, loop: Loop) -> None:
        self.validations.append((loop.state.step, dict(loop.state.metrics)))


class DrawnBoundary(Callback):
    """A step condition of a callback's own, as a port of a script that steps on its own:
    ``loop.state.step_boundary = condition(batch_idx)`` set in ``at`` (``"on_batch_start"``
    or ``"after_backward"``), the loss divided by ``divide_by`` for backward. ``steps_at``
    records the batch index of every step taken."""

    def __init__(self, condition: Callable[[int], bool], *, at: str = "on_batch_start",
                 divide_by: int = 1) -> None:
        assert at in ("on_batch_start", "after_backward"), at
        self.condition, self.at, self.divide_by = condition, at, divide_by
        self.steps_at: list[int] = []

    def scale_loss(self, loop: Loop, loss: torch.Tensor) -> torch.Tensor:
        return loss / self.divide_by

    def on_batch_start(self, loop: Loop) -> None:
        if self.at == "on_batch_start":
            loop.state.step_boundary = self.condition(loop.state.batch_idx)

    def after_backward(self, loop: Loop) -> None:
        if self.at == "after_backward":
            loop.state.step_boundary = self.condition(loop.state.batch_idx)

    def after_step(self, loop: Loop) -> None:
        self.steps_at.append(loop.state.batch_idx)


class ValidationSteps(Callback):
    """The step of every validation, the sanity check's aside."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, loop: Loop) -> None:
        if not loop.sanity_checking:
            self.steps.append(loop.state.step)


class SeenSamples(Callback):
    """Which samples each training batch held: the sum of each input row, batch by batch."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_batch_end(self, loop: Loop) -> None:
        self.batches.append(loop.state.batch[0].sum(dim=1))


class StateCapture(Callback):
    """A deep copy of ``loop.state_dict()`` at every epoch end, keyed by the epoch."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, Any]] = {}

    def on_epoch_end(self, loop: Loop) -> None:
        self.states[loop.state.epoch] = copy.deepcopy(loop.state_dict())


class Crash(Exception):
    """The exception the crash callbacks raise by default (nothing else raises it)."""


class RaiseAfterStep(Callback):
    """Raises once at the ``on_batch_end`` of optimizer step ``step``: a crash right after it.

    Args:
        step: The step after which to raise.
        exc: The exception class.
        boundary: Raise only at the batch that closes the step (under accumulation the
            step's other micro-batches end with the same step count).
    """

    def __init__(self, step: int, exc: type[BaseException] = Crash, *,
                 boundary: bool = False) -> None:
        self.step, self.exc, self.boundary, self.done = step, exc, boundary, False

    def on_batch_end(self, loop: Loop) -> None:
        if self.done or loop.state.step != self.step:
            return
        if self.boundary and not loop.state.step_boundary:
            return
        self.done = True
        raise self.exc(f"after step {self.step}")


class StopAt(Callback):
    """Asks for a resumable stop at one event of one step."""

    def __init__(self, step: int, event: str = "on_batch_end", **stop: object) -> None:
        self.step, self.event, self.stop = step, event, stop

    def _maybe(self, loop: Loop, event: str) -> None:
        if event == self.event and loop.state.step == self.step and not loop.stop_requested:
            loop.stop(f"stop at step {self.step}", **self.stop)

    def on_batch_end(self, loop: Loop) -> None:
        self._maybe(loop, "on_batch_end")

    def on_validation_end(self, loop: Loop) -> None:
        self._maybe(loop, "on_validation_end")


class Signal(Callback):
    """Sends ``number`` to this process in ``on_batch_end`` of ``step``, once."""

    def __init__(self, step: int, number: int) -> None:
        self.step, self.number, self.sent = step, number, False

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.number)
            time.sleep(0.05)  # the handler runs at the next bytecode


class RaiseAtBatch(Callback):
    """Raises once at batch ``batch`` of epoch ``epoch``, at ``event`` (before its backward).

    Args:
        epoch: The epoch.
        batch: The batch index in that epoch.
        exc: The exception class (``KeyboardInterrupt`` stands for a Ctrl-C).
        event: ``"on_batch_start"`` (before the forward) or ``"after_forward"``.
    """

    def __init__(self, epoch: int, batch: int, exc: type[BaseException] = Crash, *,
                 event: str = "on_batch_start") -> None:
        if event not in ("on_batch_start", "after_forward"):
            raise ValueError(f"RaiseAtBatch event must be on_batch_start or after_forward, "
                             f"got {event!r}")
        self.at, self.exc, self.event, self.armed = (epoch, batch), exc, event, True

    def _maybe_raise(self, loop: Loop, event: str) -> None:
        if self.armed and event == self.event \
                and (loop.state.epoch, loop.state.batch_idx) == self.at:
            self.armed = False
            raise self.exc()

    def on_batch_start(self, loop: Loop) -> None:
        self._maybe_raise(loop, "on_batch_start")

    def after_forward(self, loop: Loop) -> None:
        self._maybe_raise(loop, "after_forward")
