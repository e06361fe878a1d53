"""The training loop: iterate, forward, backward, step, emit events. Nothing else."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.data import batch_size_of, find_targets, is_pair, move_to_device
from hookloop.errors import ConfigurationError
from hookloop.events import Event
from hookloop.ordering import check_callbacks, overrides
from hookloop.rng import capture_rng, loader_generators, restore_rng
from hookloop.state import LoopState

__all__ = ["Loop"]

_NULL_CONTEXT = nullcontext()
_CONTEXT_HOOKS = ("forward_context", "train_step_context", "validation_context")


class _Table:
    """Event -> tuple of the bound methods that callbacks override, built once per fit."""

    __slots__ = tuple(event.value for event in Event) + _CONTEXT_HOOKS + ("scale_loss", "step")

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        for name in tuple(event.value for event in Event) + _CONTEXT_HOOKS + ("scale_loss",):
            setattr(self, name, tuple(getattr(c, name) for c in callbacks if overrides(c, name)))
        routers = [c for c in callbacks if overrides(c, "optimizer_step")]
        self.step = routers[0].optimizer_step if routers else None


def _annotate(exc: BaseException, handler: Callable[..., Any]) -> None:
    """Name the callback and the event on an exception, once, keeping its traceback."""
    if not getattr(exc, "_hookloop_noted", False):
        owner = type(getattr(handler, "__self__", None)).__name__
        exc.add_note(f"hookloop: raised in callback {owner} at event {handler.__name__}")
        try:
            exc._hookloop_noted = True  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - exceptions with __slots__
            pass


def _sized(data: Iterable[Any]) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


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
        self._table: _Table | None = None
        self._generators: list[torch.Generator] = []
        # Resume bookkeeping: where the weights are, in data terms (see state_dict).
        self._position: tuple[int, int, int, torch.Tensor | None, int] = (0, 0, 0, None, 0)
        self._snapshots = False
        self._position_rng: dict[str, Any] | None = None
        self._epoch_rng: dict[str, Any] | None = None
        self._resume: dict[str, Any] | None = None

    # ------------------------------------------------------------------ control
    def stop(self, reason: str | None = None) -> None:
        """End training at the next batch boundary; ``on_epoch_end``/``on_fit_end`` still fire."""
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

    def enable_resume_snapshots(self) -> None:
        """Record RNG states at every step boundary so `state_dict` can resume exactly.

        Called by ``Checkpoint``; costs a few microseconds per optimizer step.
        """
        self._snapshots = True

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
        return _sized(self.train_data)

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
        self._prepare()
        table = self._table
        assert table is not None
        state = self.state
        state.epochs, state.max_steps = epochs, max_steps
        self._stop_requested, self.stop_reason = False, None
        hook = getattr(self.optimizer, "register_step_post_hook", None)
        handle = hook(self._mark_stepped) if hook is not None else None
        self.optimizer.zero_grad(set_to_none=True)
        try:
            self._emit(table.on_fit_start)
            epoch = self._position[0]
            while epoch < epochs and not self._stop_requested and not self._steps_exhausted():
                state.epoch = epoch
                state.metrics = {}
                self._emit(table.on_epoch_start)
                completed = self._train_epoch()
                if completed and self.val_data is not None:
                    self._validate_pass()
                if completed:
                    self._mark_position(epoch + 1, 0)
                self._emit(table.on_epoch_end)
                epoch += 1
        except BaseException as exc:
            for handler in table.on_exception:
                try:
                    handler(self, exc)
                except KeyboardInterrupt:
                    raise  # a second Ctrl-C while handling the first: stop at once
                except Exception as error:  # keep going: the first exception is what matters
                    exc.add_note(f"hookloop: {type(handler.__self__).__name__}.on_exception "
                                 f"also raised {error!r}")
            try:
                self._emit(table.on_fit_end)
            except Exception as error:
                exc.add_note(f"hookloop: on_fit_end also raised {error!r}")
            raise
        else:
            self._emit(table.on_fit_end)
        finally:
            if handle is not None:
                handle.remove()
        return state

    def validate(self) -> dict[str, float]:
        """Run the validation pass alone, with its events; return the ``val_*`` metrics."""
        if self.val_data is None:
            raise ConfigurationError("validate() needs validation data: Loop(..., val_data=loader).")
        self._prepare()
        self._validate_pass()
        return {key: value for key, value in self.state.metrics.items() if key.startswith("val_")}

    def describe(self) -> str:
        """Print and return the table of which callback runs at which event."""
        from hookloop.describe import describe

        return describe(self.callbacks)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The loop's position, consistent with the current weights.

        The position is the last step boundary (or epoch end) reached: a checkpoint taken
        mid-window or mid-batch resumes from there, replaying the batches after it with the
        same random numbers when `enable_resume_snapshots` was called.
        """
        epoch, batches_done, step, loss_sum, samples = self._position
        state: dict[str, Any] = {
            "epoch": epoch,
            "batch_idx": batches_done,
            "step": step,
            "train_loss_sum": None if loss_sum is None else loss_sum.detach().cpu(),
            "train_samples": samples,
        }
        if self._snapshots and self._position_rng is not None:
            state["rng"] = self._position_rng
            if batches_done and self._epoch_rng is not None:
                state["epoch_rng"] = self._epoch_rng
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a position returned by `state_dict` at the next ``fit``."""
        loss_sum = state.get("train_loss_sum")
        self.state.epoch = int(state["epoch"])
        self.state.step = int(state["step"])
        self._position = (int(state["epoch"]), int(state["batch_idx"]), int(state["step"]),
                          None if loss_sum is None else loss_sum.to(self.device),
                          int(state.get("train_samples", 0)))
        self._resume = dict(state)
        self._position_rng = state.get("rng")
        self._epoch_rng = state.get("epoch_rng")

    # ------------------------------------------------------------------ inside
    def _mark_stepped(self, *_: Any) -> None:
        self._stepped = True

    def _steps_exhausted(self) -> bool:
        return self.state.max_steps is not None and self.state.step >= self.state.max_steps

    def _emit(self, handlers: tuple[Callable[[Loop], Any], ...]) -> None:
        for handler in handlers:
            try:
                handler(self)
            except BaseException as exc:
                _annotate(exc, handler)
                raise

    def _contexts(self, hooks: tuple[Callable[[Loop], Any], ...]) -> AbstractContextManager[Any]:
        if not hooks:
            return _NULL_CONTEXT
        if len(hooks) == 1:
            context = hooks[0](self)
            return _NULL_CONTEXT if context is None else context
        return self._stacked(hooks)

    @contextmanager
    def _stacked(self, hooks: tuple[Callable[[Loop], Any], ...]):  # type: ignore[no-untyped-def]
        with ExitStack() as stack:
            for hook in hooks:
                context = hook(self)
                if context is not None:
                    stack.enter_context(context)
            yield

    def _prepare(self) -> None:
        check_callbacks(self.callbacks, self)
        for callback in self.callbacks:
            if overrides(callback, "setup"):
                try:
                    callback.setup(self)
                except BaseException as exc:
                    _annotate(exc, callback.setup)
                    raise
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ConfigurationError(
                f"accumulation_steps must be a positive int, got {self.accumulation_steps!r}.")
        if self.batches_per_epoch == 0:
            raise ConfigurationError(
                "train_data is empty (len(train_data) == 0): check the dataset, the batch size "
                "and drop_last.")
        # Under DDP one rank's validation shard may be empty; the pass checks the total.
        if self.val_data is not None and _sized(self.val_data) == 0 and \
                distributed.world_size() == 1:
            raise ConfigurationError("val_data is empty (len(val_data) == 0): pass val_data=None "
                                     "to train without validation, or check the dataset.")
        self.model.to(self.device)
        main = distributed.is_main()
        active = [c for c in self.callbacks if main or not c.rank_zero_only]
        self._table = _Table(active)
        self._generators = loader_generators(self.train_data)

    def _compute(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """Outputs and loss of one batch, by the first rule that applies."""
        if self.forward is not None:
            result = self.forward(self, batch)
            if not isinstance(result, tuple) or len(result) != 2:
                raise ConfigurationError(
                    f"forward(loop, batch) must return (outputs, loss); it returned "
                    f"{type(result).__name__}.")
            return result
        if is_pair(batch) and self.loss_fn is not None:
            inputs, targets = batch
            outputs = self.model(inputs)
            return outputs, self.loss_fn(outputs, targets)
        if isinstance(batch, Mapping):
            outputs = self.model(**batch)
            if isinstance(outputs, Mapping) and outputs.get("loss") is not None:
                return outputs, outputs["loss"]
            if not isinstance(outputs, Mapping) and getattr(outputs, "loss", None) is not None:
                return outputs, outputs.loss
            keys = f" (keys: {', '.join(map(str, outputs))})" if isinstance(outputs, Mapping) else ""
            raise ConfigurationError(
                f"The batch is a mapping, so the model was called as model(**batch), but its "
                f"output, a {type(outputs).__name__}{keys}, has no 'loss'. Return the loss from "
                "the model (outputs['loss'] or outputs.loss), or pass forward=fn(loop, batch) -> "
                "(outputs, loss) to the Loop.")
        if is_pair(batch):
            raise ConfigurationError(
                "The batch is an (inputs, targets) pair but the Loop has no loss_fn. Pass "
                "loss_fn=fn(outputs, targets) (e.g. torch.nn.functional.cross_entropy), or "
                "forward=fn(loop, batch) -> (outputs, loss).")
        raise ConfigurationError(
            f"Cannot compute a loss from a batch of type {type(batch).__name__}. Use one of: "
            "forward=fn(loop, batch) -> (outputs, loss); (inputs, targets) batches with "
            "loss_fn=fn(outputs, targets); or mapping batches with a model returning a 'loss'.")

    @staticmethod
    def _check_loss(loss: Any, training: bool) -> None:
        if not isinstance(loss, torch.Tensor):
            raise ConfigurationError(
                f"The loss must be a scalar tensor, got {type(loss).__name__}.")
        if loss.dim() != 0:
            raise ConfigurationError(
                f"The loss must be a scalar tensor, but it has shape {tuple(loss.shape)}. "
                "Reduce it (loss.mean()) or use a loss function with reduction='mean'.")
        if training and not loss.requires_grad:
            raise ConfigurationError(
                "The loss does not require grad, so backward cannot run: it was detached, "
                "computed under torch.no_grad(), or no trainable parameter took part in it.")

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

    def _begin_epoch_iteration(self, data: Iterable[Any], skip: int) -> Any:
        """The epoch's iterator, past the ``skip`` batches already trained on.

        After `load_state_dict`, the random generators are put back as they were when the
        interrupted run created this iterator (so the data order is the same), then as they
        were after its last step (so dropout and augmentation draw the same numbers).
        """
        resume, self._resume = self._resume, None
        if resume is not None and skip and resume.get("epoch_rng") is not None:
            restore_rng(resume["epoch_rng"], self._generators)
        elif resume is not None and not skip and resume.get("rng") is not None:
            restore_rng(resume["rng"], self._generators)
        if self._snapshots and not skip:
            self._epoch_rng = capture_rng(self._generators)
        total = _sized(data)
        # skip == total still iterates: a sampler may draw from the loader's generator when
        # its iterator is exhausted (RandomSampler does, after an even last batch).
        if total is not None and skip > total:
            iterator: Any = iter(())
        else:
            iterator = iter(data)
            for _ in range(skip):
                next(iterator)
        if resume is not None and skip and resume.get("rng") is not None:
            restore_rng(resume["rng"], self._generators)
        return iterator

    def _train_epoch(self) -> bool:
        """One training pass. Returns False when `stop` ended it before the data ran out."""
        state, table = self.state, self._table
        assert table is not None
        self.model.train()
        state.training = True
        position_epoch, start, _, loss_sum, samples = self._position
        if position_epoch != state.epoch:
            start = 0
        if start == 0 or loss_sum is None:  # a fresh epoch, or a position without loss sums
            loss_sum, samples = self._accumulator(), (samples if start else 0)
        iterator = self._begin_epoch_iteration(self.train_data, start)
        window = self.accumulation_steps
        last = (self.batches_per_epoch or 0) - 1
        completed = True
        for batch_idx, batch in enumerate(iterator, start):
            if self._stop_requested or self._steps_exhausted():
                completed = False
                break
            batch = self._load_batch(batch, batch_idx)
            state.step_boundary = window == 1 or (batch_idx + 1) % window == 0 or batch_idx == last
            if table.on_batch_start:
                self._emit(table.on_batch_start)
            with self._contexts(table.train_step_context):
                with self._contexts(table.forward_context):
                    outputs, loss = self._compute(batch)
                self._check_loss(loss, training=True)
                state.outputs, state.loss = outputs, loss
                loss_sum = torch.add(loss_sum, loss.detach(), alpha=state.batch_size)
                samples += state.batch_size
                if table.after_forward:
                    self._emit(table.after_forward)
                for scale in table.scale_loss:
                    loss = scale(self, loss)
                loss.backward()
            if table.after_backward:
                self._emit(table.after_backward)
            if state.step_boundary:
                self._optimizer_step(table)
                self._position = (state.epoch, batch_idx + 1, state.step, loss_sum, samples)
                if self._snapshots:
                    self._position_rng = capture_rng(self._generators)
            if table.on_batch_end:
                self._emit(table.on_batch_end)
        if completed and samples == 0 and start == 0:
            raise ConfigurationError("train_data yielded no batches in this epoch: it is empty.")
        if samples:
            totals = distributed.all_reduce_sum(torch.stack([loss_sum, loss_sum.new_tensor(samples)]))
            sums = totals.tolist()  # the one host sync of the training pass
            state.metrics["train_loss"] = sums[0] / sums[1]
        return completed

    def _optimizer_step(self, table: _Table) -> None:
        state = self.state
        self._step_cancelled = False
        if table.before_step:
            self._emit(table.before_step)
        if not self._step_cancelled:
            self._stepped = False
            if table.step is None:
                self.optimizer.step()
            else:
                try:
                    table.step(self)
                except BaseException as exc:
                    _annotate(exc, table.step)
                    raise
            if self._stepped:
                state.step += 1
                if table.after_step:
                    self._emit(table.after_step)
        self.optimizer.zero_grad(set_to_none=True)
        if self._steps_exhausted():
            self.stop(f"max_steps={state.max_steps} reached")

    def _mark_position(self, epoch: int, batches_done: int) -> None:
        self._position = (epoch, batches_done, self.state.step, None, 0)
        if self._snapshots:
            self._position_rng = capture_rng(self._generators)

    def _validate_pass(self) -> None:
        state, table = self.state, self._table
        assert table is not None and self.val_data is not None
        self.model.eval()
        state.training = False
        loss_sum, samples = self._accumulator(), 0
        with self._contexts(table.validation_context):
            self._emit(table.on_validation_start)
            with torch.no_grad():
                for batch_idx, batch in enumerate(self.val_data):
                    batch = self._load_batch(batch, batch_idx)
                    if table.on_validation_batch_start:
                        self._emit(table.on_validation_batch_start)
                    with self._contexts(table.forward_context):
                        outputs, loss = self._compute(batch)
                    self._check_loss(loss, training=False)
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
