"""The explicit state every callback reads through ``loop.state``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hookloop.base.deprecation import REMOVED_IN
from hookloop.engine.data import batch_size_of, move_to_device
from hookloop.engine.forward import ForwardRule
from hookloop.errors import HookloopDeprecationWarning

_CPU = torch.device("cpu")

__all__ = ["LoopState", "current_batch", "learning_rates"]


def learning_rates(optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
    """The optimizer's learning rates now, as history keys: ``lr`` with one param group,
    ``lr_group0``, ``lr_group1``... with several (the names `TensorBoard` logs under
    ``step/``); none without an optimizer.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> learning_rates(torch.optim.SGD(model.parameters(), lr=0.1))
        {'lr': 0.1}
        >>> learning_rates(torch.optim.SGD([{"params": [model.weight]},
        ...                                 {"params": [model.bias], "lr": 0.5}], lr=0.1))
        {'lr_group0': 0.1, 'lr_group1': 0.5}
    """
    if optimizer is None:
        return {}
    groups = optimizer.param_groups
    if len(groups) == 1:
        return {"lr": float(groups[0]["lr"])}
    return {f"lr_group{index}": float(group["lr"]) for index, group in enumerate(groups)}


@dataclass(slots=True, repr=False)
class LoopState:
    """What the loop knows now. Slotted: a misspelt attribute raises instead of being created.

    Attributes:
        epoch: Index of the current epoch, 0-based.
        step: Optimizer steps really taken (the global step). Steps skipped by a
            GradScaler, cancelled by a callback, or inside an accumulation window do not count.
        batch_idx: Index of the batch within the current pass (training or validation).
        batch: The current batch, already on the device.
        outputs: What the model returned for the current batch.
        loss: The true loss of the current batch (never AMP-scaled or accumulation-divided).
        targets: The targets of the current batch: the second item of an ``(inputs, targets)``
            pair, or the ``labels``/``targets`` entry of a mapping batch; else None.
        batch_size: Number of samples in the current batch (used to weight the means).
        training: True during the training pass, False during validation.
        metrics: This epoch's metrics as floats: ``train_loss``, ``val_loss`` and what
            callbacks add (``val_acc``...).
        grad_norm: The pre-clip total gradient norm as a tensor, when ``GradClip`` runs.
        step_boundary: True when the current training batch ends an optimizer step. The
            loop sets it before ``on_batch_start`` from ``loop.accumulation_steps`` (every
            ``k`` batches and on the batch that ends the data; always True without
            accumulation). A callback may set it itself, for a step condition of its own:
            in ``on_batch_start`` (before forward, so ``train_step_context`` hooks such as
            DDP's ``no_sync`` see it) or in ``after_backward`` (before the step). The loop
            reads it after ``after_backward``: True takes the step, records the position
            there (what a checkpoint resumes from) and lets a requested stop take effect;
            False accumulates. See docs/concepts.md, "Who sets the step boundary".
        epochs: Total number of epochs of the current ``fit``.
        max_steps: Step budget of the current ``fit``, or None.
        min_epochs: Epochs the current ``fit`` trains at least (``fit(min_epochs=...)``): a
            stop asked earlier waits for them; None: no minimum.
        min_steps: Optimizer steps the current ``fit`` takes at least (``fit(min_steps=...)``),
            or None.
        history: The metrics of the whole run, one row per validation (and one per epoch
            that ended without one): ``{"epoch": 0-based epoch, "step": global step,
            **metrics, "lr": learning rate}`` (``lr_group0``... with several param
            groups; `learning_rates`). Restored on resume, so it survives a kill and a
            relaunch.
        prefix: The metric prefix of the evaluation pass running now: ``"val"`` in
            validation, the ``prefix`` of `Loop.evaluate` otherwise (``"test"``...). Metric
            callbacks write ``f"{prefix}_{name}"``.
    """

    epoch: int = 0
    step: int = 0
    batch_idx: int = 0
    batch: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None
    targets: Any = None
    batch_size: int = 0
    training: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    grad_norm: torch.Tensor | None = None
    step_boundary: bool = True
    epochs: int = 0
    max_steps: int | None = None
    min_epochs: int | None = None
    min_steps: int | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    prefix: str = "val"

    def set_batch(self, batch: Any, batch_idx: int, loop: Any) -> Any:
        """Move ``batch`` to ``loop.device`` and make it the current one, with its targets
        (by the loop's ``targets=`` rule) and its size; return it.

        Deprecated (it warns `hookloop.errors.HookloopDeprecationWarning`; removed in
        hookloop 0.3): the loop sets the current batch itself, through `current_batch`,
        which is handed the device and the forward rule instead of the loop. It is the one
        function below the loop still handed the loop (tests/test_architecture.py names
        it), until its removal."""
        warnings.warn("LoopState.set_batch is deprecated: the loop sets state.batch itself "
                      f"(LoopState.set_batch will be removed in hookloop {REMOVED_IN}).",
                      HookloopDeprecationWarning, stacklevel=2)
        return current_batch(self, batch, batch_idx, loop.device,
                             ForwardRule(loop, None, None, None, loop.targets))

    def record_validation(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Append the history row of a validation that counts: ``epoch``, ``step``, metrics,
        and the ``optimizer``'s learning rates then (`learning_rates`)."""
        self.history.append({"epoch": self.epoch, "step": self.step, **self.metrics,
                             **learning_rates(optimizer)})

    def record_epoch_end(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """The row of an epoch at its end (see `epoch_recorder`), as it is now."""
        self.epoch_recorder(optimizer)

    def epoch_recorder(self, optimizer: torch.optim.Optimizer | None = None
                       ) -> Callable[[], None]:
        """At an epoch's end: record its history row now, and return ``record()``, which
        adds what was written into ``metrics`` since (the loop calls it after each
        ``on_epoch_end``, so a metric a callback writes there is in the row at once).

        The row is the validation's at this step when there is one; else a row of its own,
        without the ``val_*`` values that were there at the epoch's end (an earlier
        validation's, which has its own row), with the ``optimizer``'s learning rates then
        (`learning_rates`). A ``val_*`` value written after is kept.
        """
        last = self.history[-1] if self.history else None
        stale: dict[str, Any] = {}
        if last is not None and (last["epoch"], last["step"]) == (self.epoch, self.step):
            row = last
        else:
            stale = {key: value for key, value in self.metrics.items()
                     if key.startswith(("val_", "ema_val_"))}
            row = {"epoch": self.epoch, "step": self.step, **learning_rates(optimizer)}
            self.history.append(row)

        def record() -> None:
            row.update({key: value for key, value in self.metrics.items()
                        if key not in stale or stale[key] is not value})

        record()
        return record

    @contextmanager
    def kept(self, *names: str) -> Iterator[None]:
        """Put these attributes back as they were after the block (a dict is copied first).

        Example:
            >>> state = LoopState(batch_idx=3)
            >>> with state.kept("batch_idx", "metrics"):
            ...     state.batch_idx = 0
            ...     state.metrics["val_loss"] = 1.0
            >>> state.batch_idx, state.metrics
            (3, {})
        """
        saved = [(name, getattr(self, name)) for name in names]
        saved = [(name, dict(value) if isinstance(value, dict) else value) for name, value in saved]
        try:
            yield
        finally:
            for name, value in saved:
                setattr(self, name, value)

    def __repr__(self) -> str:
        # Counters and metrics only: the batch and outputs would flood a terminal.
        return (f"LoopState(epoch={self.epoch}, step={self.step}, batch_idx={self.batch_idx}, "
                f"training={self.training}, metrics={self.metrics})")


def current_batch(state: LoopState, batch: Any, batch_idx: int, device: torch.device,
                  rule: ForwardRule) -> Any:
    """Move ``batch`` to ``device`` and make it ``state``'s current one, with its targets
    (by the ``rule``'s ``targets=``) and its size; return it."""
    state.batch_idx = batch_idx
    kind = type(batch)
    if rule.targets is None and (kind is tuple or kind is list) and len(batch) == 2:
        # A pair: what move_to_device, targets_of and batch_size_of say, without their
        # calls where its tensors are on the device already (a list is copied, as moved).
        inputs, targets = batch
        # ``device == _CPU``, not ``device.type``: that attribute costs ten times the compare.
        if type(inputs) is Tensor and type(targets) is Tensor and (
                inputs.is_cpu and targets.is_cpu if device == _CPU  # no device objects
                else inputs.device == device and targets.device == device):
            batch = batch if kind is tuple else list(batch)
        else:
            batch = move_to_device(batch, device)
            targets = batch[1]
        state.batch, state.targets = batch, targets
        shape = targets.shape if isinstance(targets, Tensor) else None
        if shape:  # one read of the shape, not dim() and then shape
            state.batch_size = shape[0]
            return batch
    else:
        state.batch = batch = move_to_device(batch, device)
        targets = state.targets = rule.targets_of(batch)
    state.batch_size = batch_size_of(batch, targets)
    return batch
