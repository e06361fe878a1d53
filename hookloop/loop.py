"""The training loop: iterate, forward, backward, step, emit events. Nothing else."""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hookloop import distributed, run_state
from hookloop.callback import Callback
from hookloop.checks import check_fit_arguments, check_fit_data, check_loop_arguments
from hookloop.data import (
    Lookahead,
    batch_size_of,
    find_targets,
    length_of,
    move_to_device,
)
from hookloop.dispatch import Handlers, Table, Wrapper, annotate, entered
from hookloop.errors import CheckpointError, ConfigurationError, Terminated
from hookloop.forward import check_loss, compute, concatenate, predict_outputs
from hookloop.modules import unwrap
from hookloop.ordering import check_callbacks, overrides
from hookloop.phase import Phase
from hookloop.position import Position, RunPosition
from hookloop.rng import capture_rng, loader_generators
from hookloop.signals import terminate_on_sigterm
from hookloop.state import LoopState
from hookloop.untouched import untouched

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
        device: Where to train; None means CUDA when available, else Apple's MPS when
            available, else CPU.
        val_every_n_epochs: Validate at the end of every n-th epoch (counted from the start
            of the run, so a resumed run keeps the cadence); None: never at epoch ends.
        val_every_n_steps: Also validate after every n-th optimizer step (``state.step``),
            for long epochs and streaming data; an epoch end right after such a validation
            does not validate again. None: not by steps.
        sanity_val_batches: Before training, run this many validation batches through the
            validation events, so a metric of the wrong shape or a missing target fails in
            seconds, not after an epoch. It changes no state, metric or random stream; 0 turns
            it off.

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
        val_every_n_epochs: int | None = 1,
        val_every_n_steps: int | None = None,
        sanity_val_batches: int = 2,
    ) -> None:
        device = check_loop_arguments(model, optimizer, train_data, val_data, loss_fn, forward,
                                      callbacks, device)
        self.model = model
        self.optimizer = optimizer
        self.train_data = train_data
        self.val_data = val_data
        self.loss_fn = loss_fn
        self.forward = forward
        self.callbacks: list[Callback] = list(callbacks)
        for label, value in (("val_every_n_epochs", val_every_n_epochs),
                             ("val_every_n_steps", val_every_n_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigurationError(f"{label} must be an int >= 1 or None, got {value!r}.")
        if isinstance(sanity_val_batches, bool) or not isinstance(sanity_val_batches, int) \
                or sanity_val_batches < 0:
            raise ConfigurationError(
                f"sanity_val_batches must be an int >= 0 (0 turns the check off), got "
                f"{sanity_val_batches!r}.")
        self.val_every_n_epochs = val_every_n_epochs
        self.val_every_n_steps = val_every_n_steps
        self.sanity_val_batches = sanity_val_batches
        self.device = device
        self.state = LoopState()
        #: Micro-batches per optimizer step; set by ``GradAccumulation`` in ``setup``.
        self.accumulation_steps = 1
        #: The ``torch.amp.GradScaler`` scaling the loss, set by ``AMP`` in ``setup`` (None
        #: without one): callbacks that read gradients or the scale find it here.
        self.scaler: torch.amp.GradScaler | None = None
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
        self._phase = Phase.IDLE
        self._validated_step = -1
        self._lookahead: Lookahead | None = None
        self._generators: list[torch.Generator] = []
        self._position = Position()  # where the weights are, in data terms (see state_dict)
        self._restore: tuple[Mapping[str, Any], str] | None = None  # applied at the next setup
        self._restored_end: Mapping[str, Any] | None = None  # why the restored run ended

    # ------------------------------------------------------------------ control
    def stop(self, reason: str | None = None) -> None:
        """End training at the next step boundary; ``on_epoch_end``/``on_fit_end`` still fire.

        Without accumulation every batch ends a step; with ``GradAccumulation`` the current
        window is finished first, so no gradient is thrown away. A later ``fit`` of this loop
        continues the epoch where it stopped, with the same data order. The run is recorded
        as ended by ``reason``: relaunched from a checkpoint with the same ``epochs``, it
        trains nothing and says why.
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

        False for an epoch that `stop` cut short: callbacks that act once per epoch (epoch
        schedulers) skip such an epoch.
        """
        return self._epoch_completed

    @property
    def phase(self) -> Phase:
        """What the loop is running now: a `Phase` (``TRAIN``, ``VALIDATE``...).

        ``loop.phase is Phase.VALIDATE`` is the validation that counts (inside ``fit``, not
        the sanity check, not an ``evaluate`` pass).
        """
        return self._phase

    @property
    def fitting(self) -> bool:
        """True inside `fit` (from ``setup`` to ``on_fit_end``), outside the passes a
        callback runs itself with `validate`, `evaluate` or `predict`."""
        return self._phase.fitting

    @property
    def sanity_checking(self) -> bool:
        """True during the short validation before training (``sanity_val_batches``).

        Callbacks that decide on metrics (best checkpoint, early stopping, plateau
        schedules, loggers) ignore that pass; its metrics are discarded.
        """
        return self._phase is Phase.SANITY_CHECK

    @contextmanager
    def _in_phase(self, phase: Phase) -> Iterator[None]:
        previous, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = previous

    @property
    def optimizer_stepped(self) -> bool:
        """True when the optimizer really stepped at the current step boundary.

        Observed through an optimizer step hook: False after a step a GradScaler skipped
        (inf/NaN gradients) or a callback cancelled. Valid from the step to the next boundary.
        """
        return self._stepped

    @property
    def position(self) -> RunPosition:
        """Where the weights are: ``(epoch, batch_idx, step)`` of the last step boundary.

        ``batch_idx`` batches of ``epoch`` were trained on; a checkpoint resumes here.
        """
        return self._position.public

    def enable_resume_snapshots(self) -> None:
        """Also record Python's and NumPy's generators at every step boundary.

        Torch's generators are always recorded; ``Checkpoint`` calls this so that a resumed
        run draws exactly what an uninterrupted one would (about 30 microseconds per step).
        """
        self._position.full_snapshots = True

    # ----------------------------------------------------------------- geometry
    @property
    def unwrapped_model(self) -> nn.Module:
        """The model without DDP/DataParallel or ``torch.compile`` wrappers."""
        return unwrap(self.model)

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

        A restore asked for with `load_state_dict` (``Checkpoint(resume=...)`` asks for one)
        is applied after every ``setup`` and before ``on_fit_start``. After an exception
        (Ctrl-C in a notebook, a failed save), calling ``fit`` again continues from the last
        step boundary with the same data order, as an uninterrupted run would have.

        Args:
            epochs: Total number of epochs of the run.
            max_steps: Optionally stop after this many optimizer steps in all.

        Returns:
            The loop's final `LoopState` (``history`` holds every validation's metrics).

        Raises:
            ConfigurationError: bad input, before the first batch where it can be seen then.
            CallbackOrderError: a callback stack that cannot work, before the first batch.
        """
        check_fit_arguments(epochs, max_steps)
        check_callbacks(self.callbacks, self)  # a stack that cannot work: nothing ran yet
        check_fit_data(self.train_data, epochs - self._position.epoch, self.val_data)
        self._bind_callbacks()
        with terminate_on_sigterm():  # a preempted job leaves a checkpoint like Ctrl-C does
            return self._fit(epochs, max_steps)

    def _fit(self, epochs: int, max_steps: int | None) -> LoopState:
        state = self.state
        state.epochs, state.max_steps = epochs, max_steps
        self._stop_requested, self.stop_reason = False, None
        # Until setup has run (DDP may create the process group), every callback listens.
        table = Table(self.callbacks)
        hook = getattr(self.optimizer, "register_step_post_hook", None)
        handle = hook(self._mark_stepped) if hook is not None else None
        self._step_observed = handle is not None
        previous_phase, self._phase = self._phase, Phase.TRAIN
        try:
            self._setup()
            table = self._table
            assert table is not None
            # A step validation the run already did (before an exception, or in the run a
            # checkpoint resumes) is not done again.
            self._validated_step = self._position.step if self._position.validated else -1
            self.optimizer.zero_grad(set_to_none=True)
            idle = self._nothing_to_train(epochs, max_steps)
            if idle is not None:
                self.stop(idle)
            self._emit(table.on_fit_start)
            if idle is not None and distributed.is_main():
                print(f"hookloop: {idle}", flush=True)
            self._check_callback_states()
            if idle is None:
                self._sanity_check()
            epoch = self._position.epoch
            while epoch < epochs and not self._stop_requested and not self._steps_exhausted():
                state.epoch = epoch
                state.metrics = {}
                self._epoch_completed = False
                self._emit(table.on_epoch_start)
                self._epoch_completed = completed = self._train_epoch()
                validated = completed and self._validation_due(epoch) and \
                    self._validated_step != state.step
                if validated:
                    self._validate_pass(self.val_data, "val")
                if completed:
                    self._position.record(epoch + 1, 0, state.step, None, 0, self._generators)
                self._emit(table.on_epoch_end)
                if completed and not validated:
                    self._record_epoch_end()
                epoch += 1
        except BaseException as exc:
            self._position.rewind()  # a later fit continues from the last step boundary
            self._live_iterator = None
            terminated: Terminated | None = None
            for handler in table.on_exception:
                try:
                    handler(self, exc)
                except KeyboardInterrupt:
                    raise  # a second Ctrl-C while handling the first: stop at once
                except Terminated as signal:  # preempted while handling: finish, then exit
                    terminated = terminated or signal
                    exc.add_note(f"hookloop: SIGTERM arrived during {_owner(handler)}"
                                 ".on_exception")
                except Exception as error:  # keep going: the first exception is what matters
                    exc.add_note(f"hookloop: {_owner(handler)}.on_exception also raised {error!r}")
            self._emit_fit_end(table, exc)
            if terminated is not None:
                raise terminated from exc  # exit with SIGTERM's status, the cause attached
            raise
        else:
            self._emit_fit_end(table, None)
        finally:
            self._phase = previous_phase
            if handle is not None:
                handle.remove()
            # Device memory of the last batch is not kept alive by the returned state.
            state.batch = state.outputs = state.loss = state.targets = None
        return state

    def validate(self) -> dict[str, float]:
        """Run the validation pass alone, with its events; return the ``val_*`` metrics.

        The model's train/eval mode is restored afterwards.
        """
        if self.val_data is None:
            raise ConfigurationError("validate() needs validation data: Loop(..., val_data=loader).")
        return self._evaluate(None, "val")  # val_data as setup leaves it (DDP shards it)

    def evaluate(self, data: Iterable[Any], *, prefix: str = "test") -> dict[str, float]:
        """A validation pass over ``data``: ``{prefix}_loss`` and every metric under ``prefix``.

        Runs the validation events and contexts (autocast with ``AMP``, the EMA weights with
        ``EMA``), without gradients, in eval mode (the model's mode is restored after).
        Values are reduced across ranks under DDP (give each rank its own shard of ``data``;
        ``validate()`` uses ``val_data`` as the ``DDP`` callback shards it). They are also
        written into ``loop.state.metrics``.

        Args:
            data: Batches of the same kind as the training data.
            prefix: The metric prefix: ``"test"`` gives ``test_loss``, ``test_acc``...

        Returns:
            The metrics of this pass, as floats.

        Example:
            >>> import torch
            >>> from hookloop import Loop
            >>> model = torch.nn.Linear(3, 1)
            >>> data = [(torch.randn(4, 3), torch.randn(4, 1))]
            >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
            ...             loss_fn=torch.nn.functional.mse_loss, device="cpu")
            >>> sorted(loop.evaluate(data, prefix="test"))
            ['test_loss']
        """
        if not isinstance(prefix, str) or not prefix.isidentifier():
            raise ConfigurationError(f"prefix must be a name such as 'test', got {prefix!r}.")
        if data is None:
            raise ConfigurationError("evaluate() needs data to evaluate, got None.")
        return self._evaluate(data, prefix)

    def _evaluate(self, data: Iterable[Any] | None, prefix: str) -> dict[str, float]:
        with self._in_phase(Phase.EVALUATE):
            self._prepare_alone()
            data = self.val_data if data is None else data
            with self._untouched(data):  # a check in the middle of work changes nothing
                self._validate_pass(data, prefix)
        return {key: value for key, value in self.state.metrics.items()
                if key.startswith(prefix + "_")}

    @torch.no_grad()
    def predict(self, data: Iterable[Any]) -> Any:
        """The model's outputs for every batch of ``data``, in order, on the CPU.

        Eval mode, no gradients, with the forward contexts (autocast with ``AMP``) and the
        validation contexts (the EMA weights with ``EMA``). No loss is computed unless
        ``forward`` computes one. A batch is fed as in training: ``forward(loop, batch)``
        when given; else the inputs of an ``(inputs, targets)`` pair (or the first item of
        a tuple or list), ``model(**batch)`` for a mapping, ``model(batch)`` for a tensor.
        Tensor outputs are concatenated along the first dimension (also inside tuples and
        mappings); other outputs come back as a list, one item per batch.

        Example:
            >>> import torch
            >>> from hookloop import Loop
            >>> model = torch.nn.Linear(3, 2)
            >>> data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(2)]
            >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
            ...             loss_fn=torch.nn.functional.mse_loss, device="cpu")
            >>> loop.predict(data).shape
            torch.Size([8, 2])
        """
        if data is None:
            raise ConfigurationError("predict() needs data, got None.")
        with self._in_phase(Phase.PREDICT):
            return self._predict(data)

    def _predict(self, data: Iterable[Any]) -> Any:
        self._prepare_alone()
        table = self._table
        assert table is not None
        outputs: list[Any] = []
        with self._untouched(data), entered(table.validation_context, self):
            self.model.eval()
            for batch in data:
                batch = move_to_device(batch, self.device)
                with entered(table.forward_context, self):
                    outputs.append(move_to_device(predict_outputs(self, batch),
                                                  torch.device("cpu")))
        return concatenate(outputs)

    def describe(self) -> str:
        """Print and return the table of which callback runs at which event."""
        from hookloop.describe import describe

        return describe(self.callbacks)

    # ---------------------------------------------------------------- run state
    def state_dict(self, *, gather: bool = True) -> dict[str, Any]:
        """The whole run, as tensors and plain values (``torch.load(weights_only=True)``).

        ``model`` (unwrapped), ``optimizer``, ``loop`` (the position of the last step
        boundary, the history, and whether and why the run ended), ``ranks`` (each rank's
        random generators and the loss sums of its shard) and ``callbacks`` (each stateful
        callback's state under its ``state_key``).

        Args:
            gather: Under DDP, gather every rank's own part (a collective: every rank must
                call it). False keeps this rank's only (for the exception path).
        """
        return run_state.capture(self, gather=gather)

    def load_state_dict(self, state: Mapping[str, Any], *, source: str | None = None) -> None:
        """Continue the run of `state_dict` at the next ``fit`` (or ``validate``).

        The state is applied after every callback's ``setup`` and before ``on_fit_start``:
        the model, the optimizer, the position, the history, and each stateful callback's
        state (a missing or unclaimed key is a warning).

        Args:
            state: What `state_dict` returned (a ``Checkpoint`` file holds it).
            source: Where it came from (a file path), named in errors.

        Raises:
            CheckpointError: at that next fit, before the first batch, when the state does
                not fit this run: another model architecture, another optimizer class or
                param-group layout.
        """
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{source or 'state'}: expected the mapping Loop.state_dict() "
                                  f"returns, got {type(state).__name__}.")
        self._restore = (state, source or "the state given to Loop.load_state_dict")

    # ------------------------------------------------------------------ inside
    def _bind_callbacks(self) -> None:
        """A callback belongs to the first loop it runs in (it holds that run's state)."""
        for callback in self.callbacks:
            owner = getattr(callback, "_hookloop_loop", None)
            if owner is not None and owner() is not self:
                raise ConfigurationError(
                    f"{callback!r} already ran in another Loop. A callback holds the state of "
                    "one run (counters, averages, schedules, best scores), so it stays with the "
                    f"loop it first ran in. Create a new {type(callback).__name__}(...) for this "
                    "loop: build the list in a function, or call the preset again.")
        for callback in self.callbacks:
            try:
                callback._hookloop_loop = weakref.ref(self)  # type: ignore[attr-defined]
            except AttributeError:  # pragma: no cover - a callback with __slots__
                pass

    def _prepare_alone(self) -> None:
        """Set up for a pass outside fit (validate, evaluate, predict)."""
        check_callbacks(self.callbacks, self)
        self._bind_callbacks()
        self._setup()

    def _ended(self) -> dict[str, Any] | None:
        """Why the run ended (a stop, its epochs, ``max_steps``), or None while it goes on."""
        state = self.state
        if self._stop_requested:
            reason = self.stop_reason or "loop.stop() was called"
        elif state.epochs and self._position.epoch >= state.epochs:
            reason = f"all {state.epochs} epochs are done"
        else:
            return None
        return {"reason": reason, "epochs": state.epochs, "max_steps": state.max_steps}

    def _nothing_to_train(self, epochs: int, max_steps: int | None) -> str | None:
        """Why this fit trains nothing (said once, before on_fit_start), or None."""
        ended, self._restored_end = self._restored_end, None
        if ended is not None:
            more_epochs = epochs > int(ended["epochs"])
            more_steps = ended.get("max_steps") is not None and (
                max_steps is None or max_steps > int(ended["max_steps"]))
            if not (more_epochs or more_steps):
                return (f"the run being resumed already ended ({ended['reason']}), so this fit "
                        f"trains nothing. Pass a larger epochs than {ended['epochs']} to continue "
                        "it, or start a new run.")
        if epochs and self._position.epoch >= epochs:
            return (f"all {epochs} epochs of this run are done, so this fit trains nothing; "
                    f"pass a larger epochs than {epochs} to train more.")
        if max_steps is not None and self.state.step >= max_steps:
            return (f"max_steps={max_steps} is already reached (step {self.state.step}), so "
                    "this fit trains nothing; pass a larger max_steps or none.")
        return None

    def _check_callback_states(self) -> None:
        run_state.check_callback_states(self.callbacks)

    def _record_history(self) -> None:
        state = self.state
        state.history.append({"epoch": state.epoch, "step": state.step, **state.metrics})

    def _record_epoch_end(self) -> None:
        """The row of an epoch whose end did not validate: its training metrics only (a
        validation earlier in the epoch has its own row); joined to the row of a validation
        at the same step."""
        state = self.state
        row = {key: value for key, value in state.metrics.items() if not key.startswith("val_")}
        last = state.history[-1] if state.history else None
        if last is not None and (last["epoch"], last["step"]) == (state.epoch, state.step):
            last.update(row)
        else:
            state.history.append({"epoch": state.epoch, "step": state.step, **row})

    def _mark_stepped(self, *_: Any) -> None:
        self._stepped = True

    def _steps_exhausted(self) -> bool:
        return self.state.max_steps is not None and self.state.step >= self.state.max_steps

    def _validation_due(self, epoch: int) -> bool:
        """At the end of ``epoch`` (0-based): does the epoch cadence ask for a validation?"""
        every = self.val_every_n_epochs
        return self.val_data is not None and every is not None and (epoch + 1) % every == 0

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
                note = f"hookloop: {_owner(handler)}.on_fit_end also raised {error!r}"
                if failure is not None:
                    failure.add_note(note)
                elif first is None:
                    first = error
                else:
                    first.add_note(note)
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
        """Run the setup hooks, check the data, move the model, restore, build the table."""
        self.accumulation_steps = 1  # the step geometry is read afresh at every fit
        self.scaler = None
        self.handler_wrapper = None
        for callback in self.callbacks:
            if overrides(callback, "setup"):
                try:
                    callback.setup(self)
                except BaseException as exc:
                    annotate(exc, callback.setup)
                    raise
        if isinstance(self.accumulation_steps, bool) or not isinstance(
                self.accumulation_steps, int) or self.accumulation_steps < 1:
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
        if self._restore is not None:
            state, source = self._restore
            run_state.restore(self, state, source)
            # validate()/evaluate()/predict() alone apply it too (the weights, the EMA), and
            # leave it for the next fit, whose setup builds what only a fit builds.
            if self.fitting:
                self._restore = None
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
        window = self.accumulation_steps
        total = self.batches_per_epoch
        wrap = None
        if total is None and window > 1:  # the last window ends where the data does: look ahead
            full = self._position.full_snapshots
            wrap = functools.partial(Lookahead, snapshot=lambda: capture_rng(self._generators,
                                                                            full=full))
        iterator, start, loss_sum, samples = self._position.start_epoch(
            state.epoch, self.train_data, self._generators, self._accumulator,
            live=live[1] if live is not None and live[0] == state.epoch else None, wrap=wrap)
        self._lookahead = iterator if isinstance(iterator, Lookahead) else None
        last = (total or 0) - 1
        every_n_steps = self.val_every_n_steps if self.val_data is not None else None
        if (start and every_n_steps is not None and state.step and not self._position.validated
                and state.step % every_n_steps == 0):
            # The run stopped (an exception, a kill) during the validation due at this step.
            self._step_validation(start, loss_sum, samples)
        completed, boundary, batch_idx = True, True, start - 1
        while True:
            # A stop takes effect at a step boundary, never inside an accumulation window.
            stopping = boundary and (self._stop_requested or self._steps_exhausted())
            # More data is known to follow: keep the iterator for a later fit. Without a
            # length (and no look-ahead), one more batch is fetched below to find out.
            more = (batch_idx + 1 < total if total is not None
                    else isinstance(iterator, Lookahead) and not iterator.exhausted)
            if stopping and more:
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
            if total is None:
                ends_data = window > 1 and iterator.exhausted  # type: ignore[union-attr]
            else:
                ends_data = batch_idx == last
            state.step_boundary = window == 1 or (batch_idx + 1) % window == 0 or ends_data
            if table.on_batch_start:
                self._emit(table.on_batch_start)
            with entered(table.train_step_context, self):
                with entered(table.forward_context, self):
                    outputs, loss = compute(self, batch)
                check_loss(loss, training=True)
                state.outputs, state.loss = outputs, loss
                if table.after_forward:
                    self._emit(table.after_forward)
                    if state.loss is not loss:  # replaced by a callback (a penalty term)
                        check_loss(state.loss, training=True, replaced=True)
                        loss = state.loss
                loss_sum = torch.add(loss_sum, loss.detach(), alpha=state.batch_size)
                samples += state.batch_size
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
                self._optimizer_step(table, batch_idx + 1, loss_sum, samples)
                if (every_n_steps is not None and self._stepped
                        and state.step % every_n_steps == 0):
                    self._step_validation(batch_idx + 1, loss_sum, samples)
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

    def _step_validation(self, batches_done: int, loss_sum: torch.Tensor, samples: int) -> None:
        """The validation every ``val_every_n_steps`` steps, at the current step boundary."""
        state = self.state
        # on_batch_end comes after this pass: it must see the training batch, not the last
        # validation batch.
        batch = (state.batch_idx, state.batch, state.outputs, state.loss, state.targets,
                 state.batch_size)
        self._validate_pass(self.val_data, "val")
        self.model.train()
        state.training = True
        (state.batch_idx, state.batch, state.outputs, state.loss, state.targets,
         state.batch_size) = batch
        # Validation draws from the generators (a DataLoader's base seed): the position's
        # snapshot is taken again, so that a resume draws what follows it.
        lookahead = self._lookahead
        self._position.record(state.epoch, batches_done, state.step, loss_sum, samples,
                              self._generators, lookahead.pending_snapshot if lookahead else None)
        self._position.validated = True

    def _optimizer_step(self, table: Table, batches_done: int, loss_sum: torch.Tensor,
                        samples: int) -> None:
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
        # The weights now match this position, whatever an after_step callback does next.
        lookahead = self._lookahead
        self._position.record(state.epoch, batches_done, state.step, loss_sum, samples,
                              self._generators, lookahead.pending_snapshot if lookahead else None)
        if self._stepped and table.after_step:
            self._emit(table.after_step)
        self.optimizer.zero_grad(set_to_none=True)
        if self._steps_exhausted():
            self.stop(f"max_steps={state.max_steps} reached")

    def _sanity_check(self) -> None:
        """A short validation before training: errors in it surface in seconds.

        Runs the first ``sanity_val_batches`` validation batches with the validation
        contexts, and sends the validation events only to the callbacks that produce metrics
        (``Metrics``...: the ones whose mistakes it is meant to find). The metrics, the
        model's mode and every random generator are put back afterwards.
        """
        if self.val_data is None or not self.sanity_val_batches or \
                hasattr(self.val_data, "__next__"):  # a one-shot iterator: nothing to spare
            return
        main = distributed.is_main()
        producers = [c for c in self.callbacks if (main or not c.rank_zero_only)
                     and list(c.produces(self))]
        state = self.state
        saved_state = (dict(state.metrics), state.history, state.batch_idx, state.batch,
                       state.outputs, state.loss, state.targets, state.batch_size, state.training)
        try:
            with self._in_phase(Phase.SANITY_CHECK), self._untouched(self.val_data):
                self._validate_pass(self.val_data, "val", limit=self.sanity_val_batches,
                                    events=Table(producers, self.handler_wrapper))
        finally:
            (state.metrics, state.history, state.batch_idx, state.batch, state.outputs,
             state.loss, state.targets, state.batch_size, state.training) = saved_state

    def _untouched(self, data: Any) -> Any:
        """A pass outside training (the sanity check, validate, evaluate, predict) leaves
        every random generator and every submodule's train/eval mode as it found them:
        iterating a DataLoader draws its base seed from torch's, and a later fit must draw
        what it would have drawn without the pass."""
        return untouched(self.model, [*self._generators, *loader_generators(self.train_data),
                                      *loader_generators(data)])

    def _validate_pass(self, data: Iterable[Any], prefix: str, limit: int | None = None,
                       events: Table | None = None) -> None:
        """One pass over ``data`` without gradients; ``events`` (default: the loop's table)
        receives the events, the loop's table gives the contexts."""
        state, contexts = self.state, self._table
        assert contexts is not None
        table = events if events is not None else contexts
        self.model.eval()
        state.training = False
        state.prefix = prefix
        loss_sum, samples = self._accumulator(), 0
        phase = Phase.VALIDATE if self._phase is Phase.TRAIN else self._phase
        try:
            with self._in_phase(phase), entered(contexts.validation_context, self):
                self._emit(table.on_validation_start)
                with torch.no_grad():
                    for batch_idx, batch in enumerate(data):
                        if limit is not None and batch_idx >= limit:
                            break
                        batch = self._load_batch(batch, batch_idx)
                        if table.on_validation_batch_start:
                            self._emit(table.on_validation_batch_start)
                        with entered(contexts.forward_context, self):
                            state.outputs, state.loss = compute(self, batch)
                        check_loss(state.loss, training=False)
                        loss_sum = torch.add(loss_sum, state.loss.detach(), alpha=state.batch_size)
                        samples += state.batch_size
                        if table.on_validation_batch_end:
                            self._emit(table.on_validation_batch_end)
                totals = distributed.all_reduce_sum(
                    torch.stack([loss_sum, loss_sum.new_tensor(samples)]))
                total_loss, total_samples = totals.tolist()
                if total_samples == 0:
                    which = "val_data" if prefix == "val" else "the data given to evaluate()"
                    raise ConfigurationError(f"{which} yielded no batches: it is empty.")
                state.metrics[f"{prefix}_loss"] = total_loss / total_samples
                self._emit(table.on_validation_end)
        finally:
            state.prefix = "val"
        if phase is Phase.VALIDATE:
            self._validated_step = state.step
            self._record_history()


def _owner(handler: Callable[..., Any]) -> str:
    return type(getattr(handler, "__self__", None)).__name__
