"""The training loop: iterate, forward, backward, step, emit events. Nothing else.

Every question the loop asks has an owner it asks: `Position` (the batches of this epoch
not trained on yet, and where the weights are), `Cadence` (is a validation due?),
`OptimizerStep` (take the step; did the optimizer really step?), `RunEnd` (has the run
ended, and why?), `hookloop.engine.sanity` (the check before training) and
`hookloop.engine.dispatch` (emitting, the exception path). The docstring of
`hookloop.base.events.Event` is this file in pseudocode.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from hookloop import distributed
from hookloop.base.phase import Phase, Phases
from hookloop.callback import Callback
from hookloop.engine import arguments, dispatch, run_end, sanity
from hookloop.engine.boundary import BoundaryStates
from hookloop.engine.cadence import Cadence
from hookloop.engine.data import LossSum
from hookloop.engine.describe import describe
from hookloop.engine.dispatch import NULL_CONTEXT, MaybeTable, Table, Wrapper
from hookloop.engine.forward import ForwardRule, Selector, check_loss, new_rule, predict_dtype
from hookloop.engine.geometry import Geometry
from hookloop.engine.ordering import check_callbacks
from hookloop.engine.position import EpochPass, Position
from hookloop.engine.position_part import PositionPart, RankPart
from hookloop.engine.state import LoopState, current_batch
from hookloop.engine.status import Status
from hookloop.engine import stateful
from hookloop.engine.stepper import OptimizerStep
from hookloop.engine.untouched import untouched
from hookloop.errors import ConfigurationError
from hookloop.runfile.weights import Weights


__all__ = ["Loop"]


class Loop(Geometry, Status):
    """A training loop that emits events; every feature is a `Callback` in ``callbacks``.

    Its step geometry (``batches_per_epoch``, ``steps_per_epoch``, ``total_steps``) and
    ``unwrapped_model`` come from `hookloop.engine.geometry.Geometry`; what it reports of
    itself (``phase``, ``fitting``, ``position``, ``stop_requested``...) from
    `hookloop.engine.status.Status`.

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
        val_at_start: Validate once before the first training step of the run (nanoGPT's
            and timm's iteration-0 evaluation): a validation that counts, at epoch 0, step
            0. Its metrics are the first row of ``state.history``; ``EarlyStopping`` and
            ``Checkpoint``'s ``best.pt`` start from it. A resumed run, or ``fit()`` again,
            does not repeat it. The sanity check is skipped then (this pass runs first).
        inputs: For mapping batches (``{"image": ..., "label": ...}``) trained with a
            ``loss_fn``: the key of the model's input (or ``fn(batch) -> inputs``; a mapping
            it returns is passed as keyword arguments, a tuple as positional ones). The
            model is called on it, in training, validation, ``predict`` and summaries.
        targets: The key of the targets (or ``fn(batch) -> targets``) given to ``loss_fn``
            and to ``Metrics``; default: the batch's ``labels`` or ``targets`` entry, or the
            second item of a pair.
        state: More objects to save and restore with the run, by name: anything with
            ``state_dict``/``load_state_dict`` (a GAN's discriminator and its optimizer:
            ``state={"discriminator": net_d, "opt_d": opt_d}``). They are in
            `state_dict` under ``"state"`` and restored before ``on_fit_start``; the loop
            neither moves nor trains them.
        loss_reduction: How a batch's loss relates to its samples, for the epoch losses
            (``train_loss``, ``val_loss``, ``evaluate``'s): ``"mean"``, the loss is the
            batch's mean, weighted by the batch size; ``"sum"``, the loss is the sum over
            the batch's samples (``reduction="sum"``, a VAE's loss), added as it is; both
            are divided by the number of samples, so the reported number is the mean loss
            per sample, as a script's ``total / len(dataset)``. ``"auto"`` (default): the
            ``reduction`` of ``loss_fn``, a torch loss module (``nn.MSELoss(reduction=
            "sum")``) or a ``functools.partial(F.mse_loss, reduction="sum")``, else ``"mean"``.

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
        hookloop: training ended at epoch 1/1, step 2: its 1 epoch is done.
        2
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 train_data: Iterable[Any], *, val_data: Iterable[Any] | None = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 forward: Callable[[Loop, Any], tuple[Any, torch.Tensor]] | None = None,
                 callbacks: Iterable[Callback] = (), device: torch.device | str | None = None,
                 val_every_n_epochs: int | None = 1, val_every_n_steps: int | None = None,
                 sanity_val_batches: int = 2, state: dict[str, Any] | None = None,
                 inputs: Selector | None = None, targets: Selector | None = None,
                 loss_reduction: str = "auto", val_at_start: bool = False) -> None:
        self.device = arguments.check_loop_arguments(
            model, optimizer, train_data, val_data, loss_fn, forward, callbacks, device,
            val_every_n_epochs=val_every_n_epochs, val_every_n_steps=val_every_n_steps,
            sanity_val_batches=sanity_val_batches, inputs=inputs, targets=targets,
            val_at_start=val_at_start)
        self.model, self.optimizer = model, optimizer
        self.train_data, self.val_data = train_data, val_data
        self.loss_fn, self.forward, self.inputs, self.targets = loss_fn, forward, inputs, targets
        self.callbacks: list[Callback] = list(callbacks)
        self.val_every_n_epochs, self.val_every_n_steps = val_every_n_epochs, val_every_n_steps
        self.sanity_val_batches, self.val_at_start = sanity_val_batches, val_at_start
        #: ``"mean"`` or ``"sum"``: how the epoch losses weigh a batch's loss (``loss_reduction``).
        self.loss_reduction = arguments.check_loss_reduction(loss_reduction, loss_fn)
        # _loss_weight: LossSum.add's, by the loss reduction
        self.state, self._loss_weight = LoopState(), (1 if self.loss_reduction == "sum" else None)
        #: More objects saved and restored with the run (``state=``), by name.
        self.extra_state = arguments.check_extra_state(state, model, optimizer)
        #: Micro-batches per optimizer step; set by ``GradAccumulation`` in ``setup``.
        self.accumulation_steps = 1
        #: Whether an epoch's last, partial window of micro-batches makes a step (False:
        #: ``GradAccumulation(last_window="drop")``); `steps_per_epoch` counts it.
        self.partial_window_steps = True
        #: The ``torch.amp.GradScaler`` scaling the loss, set by ``AMP`` in ``setup`` (None
        #: without one): callbacks that read gradients or the scale find it here.
        self.scaler: torch.amp.GradScaler | None = None
        #: ``fn(callback, event, method) -> callable`` wrapping every dispatched method
        #: (set by a profiler or tracer in its ``setup``); None dispatches the methods as they are.
        self.handler_wrapper: Wrapper | None = None
        self._phases, self._epoch_completed, self._table = Phases(), False, cast(MaybeTable, None)
        self._position: Position = Position()  # where the weights are, in data terms (state_dict)
        # _boundary: the callbacks' states at the last step boundary
        self._cadence, self._stepper, self._boundary = Cadence(), OptimizerStep(), BoundaryStates()
        self._end = run_end.RunEnd(self.state, self._position, lambda: self.total_steps)
        self._restore: tuple[Mapping[str, Any], str] | None = None  # applied at the next setup
        # The run's parts, registered once: each writes, checks and reads its own keys.
        self._weights = Weights(lambda: self.model, lambda: self.optimizer)
        self._ranks = RankPart(self._position, lambda: self.device)  # gathered at a save
        self._parts: tuple[stateful.RunPart, ...] = (
            self._weights, PositionPart(self._position, lambda: self.train_data, self._phases),
            stateful.LoopStatePart(self.state, lambda: self._position.public), self._end,
            stateful.ExtraStates(self.extra_state, self._weights),
            stateful.CallbackStates(lambda: self.callbacks, self._weights), self._ranks)

    # ------------------------------------------------------------------ control
    def stop(self, reason: str | None = None, *, resumable: bool = False,
             force: bool = False) -> None:
        """End training at the next step boundary; ``on_epoch_end``/``on_fit_end`` still fire.

        Without accumulation every batch ends a step; with ``GradAccumulation`` the current
        window is finished first, so no gradient is thrown away. A later ``fit`` of this loop
        continues the epoch where it stopped, with the same data order.

        A plain stop ends the run: it is recorded as ended by ``reason``, and relaunched
        from a checkpoint with the same ``epochs`` it trains nothing and says why (early
        stopping, a NaN). ``resumable=True`` ends only this launch (a time limit, a
        preemption): the request is voted on by every rank, training ends at the first step
        boundary where all agree, `Checkpoint` saves that step, every ``on_fit_end`` runs,
        and ``fit`` then raises `hookloop.errors.Suspended` (exit status 75); relaunched
        with the same command, the run continues exactly. SIGTERM, SIGUSR1 and
        `hookloop.callbacks.TimeLimit` end a launch this way.

        Before ``fit(min_epochs=..., min_steps=...)`` are reached, a plain stop is held
        (rank 0 says so once) and takes effect at the first boundary where they are, on
        every rank alike; ``force=True`` ends training now anyway (``TerminateOnNaN`` and
        a non-finite ``EarlyStopping`` value do: training on NaN weights goes nowhere).
        """
        self._end.stop(reason, resumable=resumable, force=force)

    def cancel_step(self) -> None:
        """From ``before_step``: skip the coming optimizer step (gradients are dropped)."""
        self._stepper.cancelled = True

    # --------------------------------------------------------------- public API
    def fit(self, epochs: int, *, max_steps: int | None = None, min_epochs: int | None = None,
            min_steps: int | None = None) -> LoopState:
        """Train until ``epochs`` epochs are done in all (a resumed run does what is left).

        A restore asked for with `load_state_dict` (``Checkpoint(resume=...)`` asks for one)
        is applied after every ``setup`` and before ``on_fit_start``. After an exception
        (Ctrl-C in a notebook, a failed save), calling ``fit`` again continues from the last
        step boundary with the same data order, as an uninterrupted run would have.

        Args:
            epochs: Total number of epochs of the run.
            max_steps: Optionally stop after this many optimizer steps in all.
            min_epochs: Train at least this many epochs in all (Lightning's ``min_epochs``):
                a stop asked earlier (``EarlyStopping``, ``loop.stop()``) is held until they
                are done. ``max_steps``, ``TerminateOnNaN`` and the end of a launch (signals,
                ``TimeLimit``) are not held.
            min_steps: Take at least this many optimizer steps in all, likewise (both
                given: both must be reached).

        Returns:
            The loop's final `LoopState` (``history`` holds every validation's metrics).

        Raises:
            ConfigurationError: bad input, before the first batch where it can be seen then.
            CallbackOrderError: a callback stack that cannot work, before the first batch.
            Suspended: after every ``on_fit_end``, when this launch ended while the run goes
                on (``stop(resumable=True)``, ``TimeLimit``, SIGTERM, SIGUSR1): a
                `SystemExit` with the documented status, so the script exits without a
                traceback; relaunch the same command to continue.
        """
        arguments.check_fit(epochs, max_steps, min_epochs, min_steps, self.callbacks, self,
                            self.train_data, self.val_data, self._position.epoch, self.optimizer)
        dispatch.bind(self.callbacks, self)
        self.state.min_epochs, self.state.min_steps = min_epochs, min_steps
        with self._end.launch(self.train_data, self.val_data):  # Suspended once it ended
            return self._fit(epochs, max_steps)

    def _fit(self, epochs: int, max_steps: int | None) -> LoopState:
        state, position = self.state, self._position
        state.epochs, state.max_steps = epochs, max_steps
        self._end.begin()
        table = Table(self.callbacks, self)  # all listen until setup ran (DDP may create the group)
        with self._stepper.observing(self.optimizer), self._phases.entered(Phase.TRAIN):
            try:
                self._boundary.attach(self.callbacks)  # no copy of an earlier fit's
                table = self._setup()
                self._cadence.begin(position, self.val_data, self.val_every_n_epochs,
                                    self.val_every_n_steps, self.val_at_start)
                self.optimizer.zero_grad(set_to_none=True)
                idle = self._end.nothing_to_train(epochs, max_steps, position.epoch, state.step)
                table.emit(table.on_fit_start)
                if idle is not None and distributed.is_main():
                    print(f"hookloop: {idle}", flush=True)
                stateful.check_callback_states(self.callbacks, self.extra_state)
                if idle is None and self._cadence.at_start:  # before the first step
                    self._validate_pass(self.val_data, "val")
                    position.mark_validated()
                elif idle is None:
                    sanity.check(self, self.callbacks, self.forward, state, self.model,
                                 self.train_data, self.val_data, self.sanity_val_batches,
                                 self.handler_wrapper, self._phases, self._validate_pass,
                                 position.generators)
                for epoch in range(position.epoch, epochs):
                    if self._end.due():
                        break
                    self._run_epoch(epoch, table)
            except BaseException as exc:
                position.rewind()  # a later fit continues from the last step boundary
                self._boundary.rewind(position.public)  # ... and so do the callbacks' states
                terminated = table.handle_exception(exc)
                if terminated is not None:
                    raise terminated from exc  # exit with SIGTERM's status, the cause attached
                raise
            else:
                table.emit_fit_end(None)
                self._end.announce()  # why the run ended, in one line (rank 0)
            finally:
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
        arguments.check_evaluation(data, prefix)
        return self._evaluate(data, prefix)

    def _evaluate(self, data: Iterable[Any] | None, prefix: str) -> dict[str, float]:
        with self._alone(Phase.EVALUATE, data) as (_, data):
            self._validate_pass(data, prefix)
        return {key: value for key, value in self.state.metrics.items()
                if key.startswith(prefix + "_")}

    @torch.no_grad()
    def predict(self, data: Iterable[Any], *, forward: Callable[[Loop, Any], Any] | None = None,
                dtype: torch.dtype | None = torch.float32) -> Any:
        """The model's outputs for every batch of ``data``, in order, on the CPU.

        Eval mode, no gradients, with the forward contexts (autocast with ``AMP``) and the
        validation contexts (the EMA weights with ``EMA``). No loss and no targets are
        needed, so unlabeled data works. A batch is fed, first rule that applies: by
        ``forward(loop, batch) -> outputs`` given here; by the loop's ``inputs=`` rule;
        by the loop's ``forward`` (its outputs); else the inputs of an ``(inputs, targets)``
        pair (or the first item of a tuple or list), ``model(**batch)`` for a mapping,
        ``model(batch)`` for a tensor. Tensor outputs are concatenated along the first
        dimension (also inside tuples and mappings); other outputs come back as a list,
        one item per batch.

        Args:
            data: Batches, labeled or not.
            forward: ``fn(loop, batch) -> outputs`` for this call (a training forward's
                ``(outputs, loss)`` works too: its outputs are taken).
            dtype: Floating outputs come back in this dtype (float32 by default, also under
                ``AMP(torch.bfloat16)``, so ``.numpy()`` works); None keeps the computed one.
                A floating ``torch.dtype`` or its name (``"float16"``); an integer dtype is
                refused (it would truncate the outputs).

        Raises:
            ConfigurationError: ``data`` None; a ``dtype`` that is not floating; a batch
                the model could not run on because of its inputs (a numpy array, float64
                data for a float32 model): naming the dtype and the fix.

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
        dtype = predict_dtype(dtype)  # before any work: an int dtype would truncate silently
        with self._alone(Phase.PREDICT, data) as (table, data), \
                table.entered(table.validation_context):
            self.model.eval()
            return self._rule().predict_all(self.state, lambda: self.model, self.device, data,
                                          table, forward, dtype)

    def describe(self) -> str:
        """Print and return the table of which callback runs at which event."""
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
        self._weights.layout(gather)  # decided once a save: whether its states are shards
        return stateful.merged([*(part.state_dict() for part in self._parts
                                  if part is not self._ranks), self._ranks.gathered(gather)])

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
        self._restore = (stateful.as_mapping(state, source),
                         source or "the state given to Loop.load_state_dict")

    # ------------------------------------------------------------------ inside
    def _rule(self) -> ForwardRule:  # read at each use: a callback may swap loss_fn or forward
        return new_rule((self, self.forward, self.loss_fn, self.inputs, self.targets))

    def _load_pending(self) -> None:
        """At setup: the state `load_state_dict` asked for, checked by every part before any
        part loads it. A fit consumes it; a pass alone (validate...) leaves it for the next
        fit, whose setup builds what only a fit builds (a scheduler from its factory)."""
        if self._restore is None:
            return
        saved, source = self._restore
        for part in self._parts:
            part.check(saved, source)
        for part in self._parts:
            part.load_state_dict(saved, source)
        self._restore = None if self.fitting else self._restore

    @contextmanager
    def _alone(self, phase: Phase, data: Any) -> Iterator[tuple[Table, Any]]:
        """A pass outside fit (validate, evaluate, predict; ``data`` None: ``val_data`` as
        setup leaves it): set up (unless a callback asks for it inside a fit or another
        pass, where all is set up), then leave every random generator and every submodule's
        train/eval mode as found, so a check in the middle of work changes nothing."""
        # From a callback inside a call (EMA's second validation): set up already.
        nested = self._table is not None and self._phases.current is not Phase.IDLE
        with self._phases.entered(phase):
            if not nested:
                check_callbacks(self.callbacks, self, self.val_data)
                dispatch.bind(self.callbacks, self)
            table = cast(Table, self._table) if nested else self._setup()
            data = self.val_data if data is None else data
            with untouched(self.model, self._position.generators, data=(self.train_data, data)):
                yield table, data

    def _setup(self) -> Table:
        """Run the setup hooks, check the data, move the model, restore, build the table."""
        self.accumulation_steps, self.scaler, self.handler_wrapper = 1, None, None
        self.partial_window_steps = True
        self._position.detach()  # the step geometry: the data's as the setup hooks leave it
        setups = Table(self.callbacks, self)  # the step geometry is read afresh at every fit
        setups.emit(setups.setup)
        arguments.check_setup(self.accumulation_steps, self.train_data, self.val_data)
        self.model.to(self.device)
        self._load_pending()
        self._table = Table(self.callbacks, self, self.handler_wrapper, main=distributed.is_main())
        self._stepper.prepare(self.state, self._rule, lambda: self.model, self.accumulation_steps,
                              routed=self._table.step is not None)
        self._position.attach(self.train_data, self.accumulation_steps, self.partial_window_steps)
        return self._table

    def _run_epoch(self, epoch: int, table: Table) -> None:
        state = self.state
        state.epoch, state.metrics, self._epoch_completed = epoch, {}, False
        self._boundary.mark(self._position)
        table.emit(table.on_epoch_start)
        self._epoch_completed = completed = self._train_epoch(table)
        if completed and self._cadence.at_epoch_end(epoch, state.step):
            self._validate_pass(self.val_data, "val")
        if completed:
            self._position.record(epoch + 1, 0, state.step, None, 0)
            # The epoch's history row takes the metrics each on_epoch_end writes, at once.
            table.emit_recording(table.on_epoch_end, state.epoch_recorder(self.optimizer))
        else:
            table.emit(table.on_epoch_end)

    def _train_epoch(self, table: Table) -> bool:
        """One training pass. Returns False when `stop` ended it before the data ran out."""
        state = self.state
        self.model.train()
        state.training = True
        batches = self._position.start_epoch(state.epoch, self.train_data, self.accumulation_steps,
                                             self.device, stop_due=self._end.due_at_boundary,
                                             check=self._rule().check_batch)
        if self._cadence.owed_on_resume(batches.start, state.step, self._position.validated):
            self._step_validation(batches)  # the run stopped during the one due at this step
        boundary, contexts = self._boundary, table.train_step_context
        for batch_idx, batch, state.step_boundary in batches:
            batch = current_batch(state, batch, batch_idx, self.device, new_rule(
                (self, self.forward, self.loss_fn, self.inputs, self.targets)))
            for handler in table.on_batch_start:  # called inline: no emit call per event
                handler(self)
            with table.entered(contexts) if contexts else NULL_CONTEXT:  # no call when none
                loss = self._forward(batch, batches, table)
                loss.backward()
            for handler in table.after_backward:
                handler(self)
            if state.step_boundary:
                self._step(batches, table)
            for handler in table.on_batch_end:
                handler(self)
            if state.step_boundary and boundary.callbacks:
                boundary.mark(self._position)
        train_loss = batches.train_loss()
        if train_loss is not None:
            state.metrics["train_loss"] = train_loss
        return bool(batches.completed)

    def _forward(self, batch: Any, batches: EpochPass, table: Table) -> torch.Tensor:
        """Outputs and loss of a training batch; returns the loss to backpropagate."""
        state, contexts = self.state, table.forward_context
        with table.entered(contexts) if contexts else NULL_CONTEXT:
            outputs, loss = new_rule((self, self.forward, self.loss_fn, self.inputs,
                                      self.targets)).compute(self.model, batch)
        if type(loss) is not torch.Tensor or loss.dim() or not loss.requires_grad:
            loss = check_loss(loss, training=True)  # a DTensor loss: its plain value
        state.outputs, state.loss = outputs, loss
        for handler in table.after_forward:
            handler(self)
        if state.loss is not loss:  # replaced by a callback (a penalty term)
            loss = state.loss = check_loss(state.loss, training=True, replaced=True)
        batches.losses.add(loss, state.batch_size, self._loss_weight)
        for handler in table.scale_loss:  # inline too: named on error as those events are
            loss = handler(self, loss)
        return loss

    def _step(self, batches: EpochPass, table: Table) -> None:
        state, stepper = self.state, self._stepper
        if stepper.take(self.optimizer, self.scaler, table):
            state.step += 1
        batches.record(state.step)  # the weights now match this position
        for handler in table.after_step if stepper.stepped else ():
            handler(self)
        self.optimizer.zero_grad(set_to_none=True)
        if state.max_steps is not None:
            self._end.check_steps()
        if stepper.stepped and self._cadence.every_n_steps is not None and \
                self._cadence.after_step(state.step):
            self._step_validation(batches)

    def _step_validation(self, batches: EpochPass) -> None:
        """The validation every ``val_every_n_steps`` steps, at the current step boundary."""
        # on_batch_end comes after this pass: it must see the training batch.
        with self.state.kept("batch_idx", "batch", "outputs", "loss", "targets", "batch_size"):
            self._validate_pass(self.val_data, "val")
            self.state.training = self._set_mode(training=True)
        # Validation draws from the generators (a DataLoader's base seed): the position's
        # snapshot is taken again, so that a resume draws what follows it.
        batches.record(self.state.step, validated=True)

    def _validate_pass(self, data: Any, prefix: str, limit: int | None = None,
                       events: Table | None = None) -> None:
        """One pass over (the first ``limit`` batches of) ``data`` without gradients; the
        events go to ``events`` (default: the loop's table), the contexts come from the loop's."""
        state, contexts = self.state, self._table
        assert contexts is not None
        table, phase = events or contexts, self._phases.current
        if phase is Phase.TRAIN:  # its data may draw from Python's and NumPy's generators
            phase, self._position.host_now = Phase.VALIDATE, False
        with self._phases.entered(phase), state.kept("prefix"):
            state.training, state.prefix = self._set_mode(training=False), prefix
            losses = LossSum(self.device)
            with contexts.entered(contexts.validation_context):
                table.emit(table.on_validation_start)
                with torch.no_grad():
                    for batch_idx, batch in enumerate(itertools.islice(data, limit)):
                        batch = current_batch(state, batch, batch_idx, self.device, self._rule())
                        if table.on_validation_batch_start:
                            table.emit(table.on_validation_batch_start)
                        with contexts.entered(contexts.forward_context):
                            state.outputs, state.loss = self._rule().compute(self.model, batch)
                        state.loss = check_loss(state.loss, training=False)
                        losses.add(state.loss, state.batch_size, self._loss_weight)
                        if table.on_validation_batch_end:
                            table.emit(table.on_validation_batch_end)
                empty = "val_data" if prefix == "val" else "the data given to evaluate()"
                state.metrics[f"{prefix}_loss"] = losses.mean(empty=empty)
                table.emit(table.on_validation_end)
        if phase is Phase.VALIDATE:
            self._cadence.validated(state.step)
            state.record_validation(self.optimizer)
