"""The training loop: iterate, forward, backward, step, emit events. Nothing else."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.data import batch_size_of, find_targets, length_of, move_to_device
from hookloop.dispatch import Handlers, Table, Wrapper, annotate, entered
from hookloop.errors import ConfigurationError
from hookloop.forward import check_loss, compute
from hookloop.ordering import check_callbacks, overrides
from hookloop.position import Position
from hookloop.rng import loader_generators
from hookloop.state import LoopState

__all__ = ["Loop"]


class Loop:
    """A training loop that emits events; every feature is a `Callback` in ``callbacks``.

    Args:
        model: The module to train. Moved to ``device`` when ``fit`` starts.
        optimizer: A ``torch.optim.Optimizer`` over the model's parameters.
        train_data: An iterable of batches, usually a ``DataLoader``.
        val_data: Optional iterable of validation batches, run after every epoch.
        loss_fn: ``fn(outputs, targets) -> scalar`` for ``(inputs, targets)`` batches.
        forward: ``fn(loop, batch) -> (outputs, loss)``; replaces the built-in rules.
        callbacks: Callbacks in execution order (the order of the list, at every event).
        device: Where to train; None means CUDA when available, else CPU.

    How the loss is computed, first rule that applies: ``forward`` if given; a pair batch
    with ``loss_fn``: ``loss_fn(model(inputs), targets)``; a mapping batch:
    ``model(**batch)`` whose output has ``["loss"]`` or ``.loss``; else a clear error.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu")
        >>> loop.fit(1).step
        2
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: Iterable[Any],
        *,
        val_data: Iterable[Any] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        forward: Callable[[Loop, Any], tuple[Any, torch.Tensor]] | None = None,
        callbacks: Iterable[Callback] = (),
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if not callable(getattr(optimizer, "step", None)) or not hasattr(optimizer, "param_groups"):
            raise ConfigurationError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}. "
                "Create one over the model's parameters: torch.optim.AdamW(model.parameters())."
            )
        if isinstance(callbacks, Callback):
            raise ConfigurationError("callbacks must be a list of callbacks: callbacks=[...].")
        self.model = model
        self.optimizer = optimizer
        self.train_data = train_data
        self.val_data = val_data
        self.loss_fn = loss_fn
        self.forward = forward
        self.callbacks: list[Callback] = list(callbacks)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.state = LoopState()
        #: Micro-batches per optimizer step; set by ``GradAccumulation`` in ``setup``.
        self.accumulation_steps = 1
        self.stop_reason: str | None = None
        self._stop_requested = False
        self._step_cancelled = False
        self._stepped = False
        self._step_observed = True
        self._epoch_completed = False
        self._live_iterator: tuple[int, Any] | None = None  # an epoch stop() cut short
        self._table: Table | None = None
        #: ``fn(callback, event, method) -> callable`` wrapping every dispatched method
        #: (set by a profiler or tracer in its ``setup``); None dispatches the methods as they are.
        self.handler_wrapper: Wrapper | None = None
        self._fitting = False
        self._generators: list[torch.Generator] = []
        self._position = Position()  # where the weights are, in data terms (see state_dict)

    # ------------------------------------------------------------------ control
    def stop(self, reason: str | None = None) -> None:
        """End training at the next step boundary; ``on_epoch_end``/``on_fit_end`` still fire.

        Without accumulation every batch ends a step; with ``GradAccumulation`` the current
        window is finished first, so no gradient is thrown away. A later ``fit`` continues the
        epoch where it stopped, with the same data order.
        """
        self._stop_requested = True
        self.stop_reason = reason

    @property
    def stop_requested(self) -> bool:
        """True once `stop` was called in this fit."""
        return self._stop_requested

    def cancel_step(self) -> None:
        """From ``before_step``: skip the coming optimizer step (gradients are dropped)."""
        self._step_cancelled = True

    @property
    def step_cancelled(self) -> bool:
        """True when a callback cancelled the step of the current step boundary."""
        return self._step_cancelled

    @property
    def epoch_completed(self) -> bool:
        """In ``on_epoch_end``: True when the training pass ran through all the data.

        False for an epoch that `stop` cut short (no validation ran in it): callbacks that
        act once per epoch (epoch schedulers, early stopping) skip such an epoch.
        """
        return self._epoch_completed

    @property
    def fitting(self) -> bool:
        """True inside `fit` (from ``setup`` to ``on_fit_end``); False in `validate` alone."""
        return self._fitting

    @property
    def optimizer_stepped(self) -> bool:
        """True when the optimizer really stepped at the current step boundary.

        Observed through an optimizer step hook: False after a step a GradScaler skipped
        (inf/NaN gradients) or a callback cancelled. Valid from the step to the next boundary.
        """
        return self._stepped

    def enable_resume_snapshots(self) -> None:
        """Record RNG states at every step boundary so `state_dict` can resume exactly.

        Called by ``Checkpoint``; costs a few microseconds per optimizer step.
        """
        self._position.snapshots = True

    # ----------------------------------------------------------------- geometry
    @property
    def unwrapped_model(self) -> nn.Module:
        """The model without DDP/DataParallel or ``torch.compile`` wrappers."""
        model = self.model
        while True:
            if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
                model = model.module
            elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
                model = model._orig_mod
            else:
                return model

    @property
    def batches_per_epoch(self) -> int | None:
        """``len(train_data)``, or None for data without a length."""
        return length_of(self.train_data)

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps per epoch (accumulation and sharding accounted), or None."""
        batches = self.batches_per_epoch
        return None if batches is None else math.ceil(batches / self.accumulation_steps)

    @property
    def total_steps(self) -> int | None:
        """Optimizer steps the current fit makes in all, from its start (or None)."""
        per_epoch = self.steps_per_epoch
        total = None if per_epoch is None else per_epoch * self.state.epochs
        if self.state.max_steps is not None:
            total = self.state.max_steps if total is None else min(total, self.state.max_steps)
        return total

    # --------------------------------------------------------------- public API
    def fit(self, epochs: int, *, max_steps: int | None = None) -> LoopState:
        """Train until ``epochs`` epochs are done in all (a resumed run does what is left).

        Args:
            epochs: Total number of epochs of the run.
            max_steps: Optionally stop after this many optimizer steps in all.

        Returns:
            The loop's final `LoopState`.

        Raises:
            ConfigurationError: bad input, before the first batch where it can be seen then.
            CallbackOrderError: a callback stack that cannot work, before the first batch.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ConfigurationError(f"epochs must be a non-negative int, got {epochs!r}.")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ConfigurationError(f"max_steps must be a positive int or None, got {max_steps!r}.")
        check_callbacks(self.callbacks, self)  # a stack that cannot work: nothing ran yet
        state = self.state
        state.epochs, state.max_steps = epochs, max_steps
        self._stop_requested, self.stop_reason = False, None
        # Until setup has run (DDP may create the process group), every callback listens.
        table = Table(self.callbacks)
        hook = getattr(self.optimizer, "register_step_post_hook", None)
        handle = hook(self._mark_stepped) if hook is not None else None
        self._step_observed = handle is not None
        self._fitting = True
        try:
            self._setup()
            table = self._table
            assert table is not None
            self.optimizer.zero_grad(set_to_none=True)
            self._emit(table.on_fit_start)
            epoch = self._position.epoch
            while epoch < epochs and not self._stop_requested and not self._steps_exhausted():
                state.epoch = epoch
                state.metrics = {}
                self._epoch_completed = False
                self._emit(table.on_epoch_start)
                self._epoch_completed = completed = self._train_epoch()
                if completed and self.val_data is not None:
                    self._validate_pass()
                if completed:
                    self._position.record(epoch + 1, 0, state.step, None, 0, self._generators)
                self._emit(table.on_epoch_end)
                if completed and self.val_data is None:
                    self._record_history()
                epoch += 1
        except BaseException as exc:
            for handler in table.on_exception:
                try:
                    handler(self, exc)
                except KeyboardInterrupt:
                    raise  # a second Ctrl-C while handling the first: stop at once
                except Exception as error:  # keep going: the first exception is what matters
                    exc.add_note(f"hookloop: {type(getattr(handler, '__self__', None)).__name__}.on_exception "
                                 f"also raised {error!r}")
            self._emit_fit_end(table, exc)
            raise
        else:
            self._emit_fit_end(table, None)
        finally:
            self._fitting = False
            if handle is not None:
                handle.remove()
        return state

    def validate(self) -> dict[str, float]:
        """Run the validation pass alone, with its events; return the ``val_*`` metrics.

        The model's train/eval mode is restored afterwards.
        """
        if self.val_data is None:
            raise ConfigurationError("validate() needs validation data: Loop(..., val_data=loader).")
        check_callbacks(self.callbacks, self)
        self._setup()
        was_training = self.model.training
        try:
            self._validate_pass()
        finally:
            self.model.train(was_training)  # a check in the middle of work changes nothing
        return {key: value for key, value in self.state.metrics.items() if key.startswith("val_")}

    def describe(self) -> str:
        """Print and return the table of which callback runs at which event."""
        from hookloop.describe import describe

        return describe(self.callbacks)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The loop's position, consistent with the current weights (see `Position`).

        The last step boundary (or epoch end) reached: a checkpoint taken mid-window or
        mid-batch resumes from there, replaying the batches after it with the same random
        numbers when `enable_resume_snapshots` was called.
        """
        return self._position.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a position returned by `state_dict` at the next ``fit``."""
        self._position.load_state_dict(state, self.device)
        self._live_iterator = None
        self.state.epoch, self.state.step = self._position.epoch, self._position.step

    # ------------------------------------------------------------------ inside
    def _record_history(self) -> None:
        state = self.state
        state.history.append({"epoch": state.epoch, "step": state.step, **state.metrics})

    def _mark_stepped(self, *_: Any) -> None:
        self._stepped = True

    def _steps_exhausted(self) -> bool:
        return self.state.max_steps is not None and self.state.step >= self.state.max_steps

    def _emit_fit_end(self, table: Table, failure: BaseException | None) -> None:
        """Every ``on_fit_end`` runs, even after one raised (they close files, groups...).

        With ``failure`` (fit is already raising), their errors become notes on it;
        otherwise the first error is raised once all have run. Ctrl-C stops at once.
        """
        first: BaseException | None = None
        for handler in table.on_fit_end:
            try:
                handler(self)
            except KeyboardInterrupt:
                raise
            except Exception as error:
                annotate(error, handler)
                if failure is not None:
                    failure.add_note(f"hookloop: {type(getattr(handler, '__self__', None)).__name__}.on_fit_end "
                                     f"also raised {error!r}")
                elif first is None:
                    first = error
                else:
                    first.add_note(f"hookloop: {type(getattr(handler, '__self__', None)).__name__}.on_fit_end "
                                   f"also raised {error!r}")
        if first is not None:
            raise first

    def _emit(self, handlers: Handlers) -> None:
        for handler in handlers:
            try:
                handler(self)
            except BaseException as exc:
                annotate(exc, handler)
                raise

    def _setup(self) -> None:
        """Run the setup hooks, check the data, move the model, build the dispatch table."""
        for callback in self.callbacks:
            if overrides(callback, "setup"):
                try:
                    callback.setup(self)
                except BaseException as exc:
                    annotate(exc, callback.setup)
                    raise
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ConfigurationError(
                f"accumulation_steps must be a positive int, got {self.accumulation_steps!r}.")
        if self.batches_per_epoch == 0:
            raise ConfigurationError(
                "train_data is empty (len(train_data) == 0): check the dataset, the batch size "
                "and drop_last.")
        # Under DDP one rank's validation shard may be empty; the pass checks the total.
        if self.val_data is not None and length_of(self.val_data) == 0 and \
                distributed.world_size() == 1:
            raise ConfigurationError("val_data is empty (len(val_data) == 0): pass val_data=None "
                                     "to train without validation, or check the dataset.")
        self.model.to(self.device)
        main = distributed.is_main()
        active = [c for c in self.callbacks if main or not c.rank_zero_only]
        self._table = Table(active, self.handler_wrapper)
        self._generators = loader_generators(self.train_data)

    def _load_batch(self, batch: Any, batch_idx: int) -> Any:
        state = self.state
        state.batch_idx = batch_idx
        batch = move_to_device(batch, self.device)
        state.batch = batch
        state.targets = find_targets(batch)
        state.batch_size = batch_size_of(batch, state.targets)
        return batch

    def _accumulator(self) -> torch.Tensor:
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        return torch.zeros((), dtype=dtype, device=self.device)

    def _train_epoch(self) -> bool:
        """One training pass. Returns False when `stop` ended it before the data ran out."""
        state, table = self.state, self._table
        assert table is not None
        self.model.train()
        state.training = True
        live, self._live_iterator = self._live_iterator, None
        iterator, start, loss_sum, samples = self._position.start_epoch(
            state.epoch, self.train_data, self._generators, self._accumulator,
            live=live[1] if live is not None and live[0] == state.epoch else None)
        window = self.accumulation_steps
        total = self.batches_per_epoch
        last = (total or 0) - 1
        completed, boundary, batch_idx = True, True, start - 1
        while True:
            # A stop takes effect at a step boundary, never inside an accumulation window.
            stopping = boundary and (self._stop_requested or self._steps_exhausted())
            if stopping and (total is None or batch_idx + 1 < total):
                self._live_iterator = (state.epoch, iterator)  # a later fit continues it
                completed = False
                break
            try:
                batch = next(iterator)
            except StopIteration:
                break
            if stopping:  # the data outlived its len(): keep it for a later fit
                self._live_iterator = (state.epoch, itertools.chain([batch], iterator))
                completed = False
                break
            batch_idx += 1
            batch = self._load_batch(batch, batch_idx)
            state.step_boundary = window == 1 or (batch_idx + 1) % window == 0 or batch_idx == last
            if table.on_batch_start:
                self._emit(table.on_batch_start)
            with entered(table.train_step_context, self):
                with entered(table.forward_context, self):
                    outputs, loss = compute(self, batch)
                check_loss(loss, training=True)
                state.outputs, state.loss = outputs, loss
                loss_sum = torch.add(loss_sum, loss.detach(), alpha=state.batch_size)
                samples += state.batch_size
                if table.after_forward:
                    self._emit(table.after_forward)
                for scale in table.scale_loss:
                    try:
                        loss = scale(self, loss)
                    except BaseException as exc:
                        annotate(exc, scale)
                        raise
                loss.backward()
            if table.after_backward:
                self._emit(table.after_backward)
            if state.step_boundary:
                self._optimizer_step(table)
                self._position.record(state.epoch, batch_idx + 1, state.step, loss_sum, samples,
                                      self._generators)
            if table.on_batch_end:
                self._emit(table.on_batch_end)
            boundary = state.step_boundary
        if completed and samples == 0 and start == 0:
            raise ConfigurationError("train_data yielded no batches in this epoch: it is empty.")
        if samples:
            totals = distributed.all_reduce_sum(torch.stack([loss_sum, loss_sum.new_tensor(samples)]))
            sums = totals.tolist()  # the one host sync of the training pass
            state.metrics["train_loss"] = sums[0] / sums[1]
        return completed

    def _optimizer_step(self, table: Table) -> None:
        state = self.state
        self._step_cancelled = False
        if table.before_step:
            self._emit(table.before_step)
        self._stepped = False
        if not self._step_cancelled:
            if table.step is None:
                self.optimizer.step()
            else:
                try:
                    table.step(self)
                except BaseException as exc:
                    annotate(exc, table.step)
                    raise
            if not self._step_observed:  # an optimizer without step hooks: trust the call
                self._stepped = True
            if self._stepped:
                state.step += 1
                if table.after_step:
                    self._emit(table.after_step)
        self.optimizer.zero_grad(set_to_none=True)
        if self._steps_exhausted():
            self.stop(f"max_steps={state.max_steps} reached")

    def _validate_pass(self) -> None:
        state, table = self.state, self._table
        assert table is not None and self.val_data is not None
        self.model.eval()
        state.training = False
        loss_sum, samples = self._accumulator(), 0
        with entered(table.validation_context, self):
            self._emit(table.on_validation_start)
            with torch.no_grad():
                for batch_idx, batch in enumerate(self.val_data):
                    batch = self._load_batch(batch, batch_idx)
                    if table.on_validation_batch_start:
                        self._emit(table.on_validation_batch_start)
                    with entered(table.forward_context, self):
                        outputs, loss = compute(self, batch)
                    check_loss(loss, training=False)
                    state.outputs, state.loss = outputs, loss
                    loss_sum = torch.add(loss_sum, loss.detach(), alpha=state.batch_size)
                    samples += state.batch_size
                    if table.on_validation_batch_end:
                        self._emit(table.on_validation_batch_end)
            totals = distributed.all_reduce_sum(torch.stack([loss_sum, loss_sum.new_tensor(samples)]))
            total_loss, total_samples = totals.tolist()
            if total_samples == 0:
                raise ConfigurationError("val_data yielded no batches: it is empty.")
            state.metrics["val_loss"] = total_loss / total_samples
            self._emit(table.on_validation_end)
        if self._fitting:
            self._record_history()
