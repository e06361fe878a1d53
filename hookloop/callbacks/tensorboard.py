"""TensorBoard logging: losses, learning rates, metrics, histograms, graph and hyper-parameters."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from hookloop.base.checks import check_flag, check_int, check_optional_int, check_path
from hookloop.base.compat import summary_file_writer, summary_writer_thread
from hookloop.callback import Callback
from hookloop.engine.forward import model_inputs
from hookloop.engine.untouched import untouched
from hookloop.errors import ConfigurationError, LogWriteError
from hookloop.runfile.sharded import is_sharded_tensor
from hookloop.scalars import MetricSteps, gather_hparams, read_values, step_due, step_values

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from hookloop.loop import Loop

__all__ = ["TensorBoard", "gather_hparams"]

_Scalar = (int, float, str, bool)

class TensorBoard(Callback):
    """Write TensorBoard event files under ``log_dir`` (rank 0 only).

    What is logged, and under which tag (x axis: ``loop.state.step``, the global step):

    * every ``every_n_steps`` optimizer steps: ``step/loss`` (the true loss of the batch
      that completed the step), ``step/lr`` (``step/lr_group{i}`` with several param
      groups), ``step/grad_norm`` when `GradClip` ran, ``step/loss_scale`` when `AMP` uses
      a GradScaler. The values stay on the device on other steps and are read together,
      once, on a logging step: no host sync on the steps in between.
    * every entry of ``loop.state.metrics`` as ``metrics/<name>`` at each validation end,
      and at each epoch end for those not logged at that step yet (``train_loss`` without
      validation data, metrics written after validation). Validation metrics (``val_*``)
      appear once per validation, at its step: an epoch end that did not validate (with
      ``val_every_n_steps``, or ``val_every_n_epochs=k > 1``) logs only the other metrics,
      as ``loop.state.history`` does.
    * with ``histograms_every_n_epochs=k``: ``weights/<param>`` and ``gradients/<param>``
      every k-th epoch, at its last optimizer step (the gradients exist only until
      ``zero_grad``). Off by default: histograms are slow to write and to load. A sharded
      parameter (`FSDP`, `TensorParallel`) is shown by rank 0's shard, tagged
      ``<param>@rank0-shard``.
    * with ``graph=True``: the model graph, traced from the first training batch in eval
      mode without gradients (modes, BatchNorm statistics and RNG streams are restored).
      A model that cannot be traced gives a warning, never an error.
    * when the writer opens, before the first batch (so a run that dies still shows
      them): the hyper-parameters, for the HPARAMS tab: ``hparams`` if given, else
      `gather_hparams` (the optimizer's settings per group, batch size, epochs,
      accumulation, each callback's constructor arguments by callback name). They are
      written as the hparams plugin's session start, and the ``metrics/*`` (and
      ``step/*``) scalars of the same directory are the metrics the tab links them to: it
      shows each one's latest value. At the run's end the session is marked finished
      (not after an exception, nor at the end of a launch that a signal or ``TimeLimit``
      ended while the run goes on).
      Each run directory holds its own session, so ``tensorboard --logdir runs`` compares
      the runs under ``runs/``. A relaunch that resumes the run from a checkpoint writes
      no second session start: the tab keeps the first launch's values.

    The writer (``torch.utils.tensorboard.SummaryWriter``) is ``self.writer``; other
    callbacks may log through it (images, text...). It is opened at the first epoch of a
    fit (or when ``writer`` is first read), flushed at every epoch end and whenever a
    checkpoint takes this callback's state, and closed at fit end, also after an exception.

    A write that fails (a full disk, a directory that is gone) raises
    `hookloop.LogWriteError` naming the event file and the cause, at the event that
    wrote: training stops there, as it would for a failed checkpoint, because the run's
    record would go on with a hole nobody sees. After it nothing is written to that
    writer again, and the checkpoint taken on the way out (``Checkpoint.on_exception``)
    does not flush it, so the checkpoint is still written; a relaunch with
    ``Checkpoint(..., resume=True)`` continues in the same ``log_dir``. What the writer
    held since its last successful write is lost.

    Resume: a run resumed from a checkpoint appends to the same ``log_dir``; the writer
    starts with ``purge_step`` at the resumed step, so TensorBoard drops what the killed
    run logged after the checkpoint, including everything logged at the resumed step
    itself. What this callback logged at that step is written again: the scalars and the
    gradient histograms (kept in its checkpointed state, a few KB per parameter), and the
    weight histograms (computed again from the restored weights, which are the weights of
    that step). Each step appears once. What other callbacks logged through ``writer`` at
    the resumed step (images, text...) is not written again.
    A new run started at step 0 in a directory that already holds event files hides them
    the same way (and warns): give each experiment its own ``log_dir``.

    Args:
        log_dir: The run directory (created if missing), e.g. ``"runs/resnet-lr0.1"``.
        every_n_steps: Step interval of the ``step/*`` scalars.
        histograms_every_n_epochs: Epoch interval of weight and gradient histograms;
            None (default) for none.
        graph: Log the model graph from the first batch.
        hparams: Hyper-parameters to log (numbers, strings, booleans); None gathers them
            from the loop (`gather_hparams`).
        flush_secs: How often the writer flushes by itself, in seconds.

    Raises:
        ConfigurationError: a bad interval or a non-mapping ``hparams``.
        LogWriteError: during fit, the event file could not be written.

    Example:
        >>> import tempfile, torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
        >>> log_dir = tempfile.mkdtemp()
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[TensorBoard(log_dir, every_n_steps=2)])
        >>> loop.fit(1).step
        hookloop: training ended at epoch 1/1, step 4: its 1 epoch is done.
        4
    """

    state_at_boundaries = True  # its state changes at steps and epochs (and state_dict flushes)

    rank_zero_only = True

    def __init__(self, log_dir: str | os.PathLike[str] = "runs", *, every_n_steps: int = 50,
                 histograms_every_n_epochs: int | None = None, graph: bool = False,
                 hparams: Mapping[str, Any] | None = None, flush_secs: int = 30) -> None:
        if hparams is not None and not isinstance(hparams, Mapping):
            raise ConfigurationError(
                f"TensorBoard hparams must be a dict of name -> number/str/bool or None, got "
                f"{hparams!r}.")
        self.log_dir = check_path("TensorBoard log_dir", log_dir)
        self.every_n_steps = check_int("TensorBoard every_n_steps", every_n_steps)
        self.histograms_every_n_epochs = check_optional_int(
            "TensorBoard histograms_every_n_epochs", histograms_every_n_epochs,
            hint="None logs no histograms.")
        self.graph = check_flag("TensorBoard graph", graph)
        self.hparams = None if hparams is None else dict(hparams)
        self.flush_secs = check_int("TensorBoard flush_secs", flush_secs)
        self._writer: SummaryWriter | None = None
        self._writer_class: Any = None
        self._loop: Loop | None = None
        # What was logged at the latest step: written again after a resume purges that step.
        self._latest_step = -1
        self._latest: dict[str, float] = {}
        self._metric_steps = MetricSteps()
        self._graph_done = False
        self._histogram_epoch = -1
        # The gradient histograms (serialized summaries) of the latest histogram step: the
        # gradients are gone after zero_grad, so a resume that purges it replays these.
        self._histogram_step = -1
        self._gradient_histograms: dict[str, bytes] = {}
        self._epoch_ran = False
        self._failed = False
        self._continued = False  # a checkpoint restored this run: its session started before
        self._file: str | None = None  # this writer's event file, named in errors
        self._files_before: set[str] = set()  # the event files log_dir held before it
        self._failure: LogWriteError | None = None  # the first failed write of this writer
        self._failure_raised = False
        # None: writes as usual. True/False: a replica group's writer turn under
        # FaultTolerance (see `hold_writes`): held, scalars are kept in memory only.
        self._held: bool | None = None

    def __repr__(self) -> str:
        return f"TensorBoard({self.log_dir!r}, every_n_steps={self.every_n_steps})"

    # ------------------------------------------------------------------ writer
    def hold_writes(self, loop: Loop, held: bool) -> None:
        """Give this step's writing to another process (``held``), or take it (the replica
        group that writes this step's rows under `FaultTolerance`, which calls this after
        each step's commit).

        Held, the callback keeps computing its scalars (the latest step's stay in memory, and
        travel to a peer in `state_dict`) but writes nothing and closes its event file.
        Taking the turn opens a new event file that sorts after every earlier one, with
        ``purge_step`` at the current step, whose scalars it writes again: what the previous
        writer may have logged of that step (or half logged before it died) is dropped, and
        every step is in the directory once. The writer flushes after every step, so a
        writer that dies loses nothing its successor cannot replay.
        """
        first, self._held = self._held is None, held
        if held:
            self._close()
        elif self._writer is None:
            # the first turn of a new run is the run's start; any other continues the run
            self._continued = self._continued or (not first and loop.state.step > 0)
            self._open(loop)

    @property
    def writer(self) -> SummaryWriter:
        """The ``SummaryWriter`` of this run, for other callbacks to log through.

        Raises:
            RuntimeError: read outside ``fit`` (the writer exists from fit start to fit end).
        """
        if self._failure is not None:
            self._failure_raised = True
            raise self._failure
        if self._writer is None:
            loop = self._loop
            if loop is None or not loop.fitting:
                raise RuntimeError(
                    "TensorBoard.writer exists only during fit (from on_fit_start to "
                    "on_fit_end); read it from a callback's event method.")
            self._open(loop)
        assert self._writer is not None
        return self._writer

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Around every write to the event file: a failure is a `LogWriteError` naming the
        file and the cause; after it the writer is not touched again (its background thread
        would raise the same error at every call)."""
        if self._failure is not None:
            self._failure_raised = True
            raise self._failure
        try:
            yield
        except LogWriteError:
            raise
        except OSError as error:
            self._failure = LogWriteError.of("TensorBoard", self._event_file(), error)
            self._failure_raised = True
            raise self._failure from error

    def _event_file(self) -> str:
        """The event file of this writer (named in errors): the one its opening created."""
        if self._file is None:
            with contextlib.suppress(OSError):
                created = sorted(_event_files(self.log_dir) - self._files_before)
                if created:
                    self._file = os.path.join(self.log_dir, created[-1])
        return self._file or self.log_dir

    def _open(self, loop: Loop) -> None:
        self._file, self._files_before = None, set()
        with self._writing():
            os.makedirs(self.log_dir, exist_ok=True)
            self._files_before = _event_files(self.log_dir)
        self._open_writer(loop, bool(self._files_before))
        self._event_file()
        if self._epoch_ran and not self._continued:  # its settings, before the first batch
            self._add_session_start(loop)

    def _open_writer(self, loop: Loop, earlier: bool) -> None:
        step = loop.state.step
        purge_step: int | None = None
        replay: dict[str, float] = {}
        if earlier and self._held is not None:
            _after_files_of(self.log_dir)  # the reader goes by file name: this one is last
        if earlier:
            if self._latest_step == step:
                purge_step, replay = step, dict(self._latest)
            elif step > 0:  # nothing known of what was logged at `step`: keep it
                purge_step = step + 1
            else:
                purge_step = 0
                warnings.warn(
                    f"TensorBoard: {self.log_dir!r} already holds event files and this run "
                    "starts at step 0, so TensorBoard will hide the earlier events (purge_step=0)."
                    " Give each experiment its own log_dir, e.g. runs/<name>.",
                    RuntimeWarning, stacklevel=3)
        with self._writing():  # the writer writes and flushes its first event here
            self._writer = self._writer_class(self.log_dir, purge_step=purge_step,
                                              flush_secs=self.flush_secs)
        _quiet_thread(self._writer)
        if replay:
            self._latest = {}
            for tag, value in replay.items():
                self._scalar(tag, value, step)
        if purge_step == step and self._histogram_step == step:
            self._add_histograms(loop, gradients=self._gradient_histograms)

    def _close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            if self._failure is None:
                with self._writing():
                    writer.flush()
        finally:
            with contextlib.suppress(OSError):  # a failed writer: stop its thread, close the file
                writer.close()

    def _flush(self) -> None:
        if self._writer is not None:
            with self._writing():
                self._writer.flush()

    def _scalar(self, tag: str, value: float, step: int) -> None:
        if step != self._latest_step:
            self._latest_step, self._latest = step, {}
        self._latest[tag] = value
        if self._held:
            return
        writer = self.writer
        with self._writing():
            writer.add_scalar(tag, value, step)

    # ------------------------------------------------------------------ events
    def setup(self, loop: Loop) -> None:
        """Import ``torch.utils.tensorboard`` (and tensorboard) now, not at ``import hookloop``."""
        if self._writer_class is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer_class = SummaryWriter
        self._loop = loop

    def on_fit_start(self, loop: Loop) -> None:
        """Reset the per-fit bookkeeping; the writer opens at the first epoch."""
        self._epoch_ran = self._failed = self._graph_done = False
        self._failure, self._failure_raised = None, False  # a new writer is tried
        self._metric_steps.reset()
        self._histogram_epoch = -1

    def on_epoch_start(self, loop: Loop) -> None:
        """Open the writer (after a checkpoint restored the step, for purge_step); at the
        fit's first epoch, write the hyper-parameters."""
        first, self._epoch_ran = not self._epoch_ran, True
        if self._held is not None:
            return  # the writer turn opens it (`hold_writes`)
        if self._writer is None:
            self._open(loop)
        elif first and not self._continued:  # another callback opened the writer first
            self._add_session_start(loop)

    @property
    def _silent_events(self) -> tuple[str, ...]:
        """Without ``graph``, nothing to do at a batch start: not called there."""
        own = type(self).on_batch_start is TensorBoard.on_batch_start  # else a subclass's
        return () if self.graph or not own else ("on_batch_start",)

    def on_batch_start(self, loop: Loop) -> None:
        """Trace the graph from the first batch, once, when asked."""
        if self.graph and not self._graph_done and not self._held:
            self._graph_done = True
            self._add_graph(loop)

    def after_step(self, loop: Loop) -> None:
        """Every ``every_n_steps``: loss, learning rates, grad norm, loss scale (one read).

        Another step without histograms returns at once: one modulo, nothing built."""
        state = loop.state
        step = state.step
        if step % self.every_n_steps and self.histograms_every_n_epochs is None:
            return
        if step_due(loop, self.every_n_steps):
            for tag, number in read_values(step_values(loop)).items():
                self._scalar(tag, number, step)
        every = self.histograms_every_n_epochs
        if every is not None and (state.epoch + 1) % every == 0 and self._histogram_epoch != state.epoch:
            total = loop.batches_per_epoch
            # The epoch's last step, when the data has a length; else its first step.
            if total is None or state.batch_idx == total - 1:
                self._histogram_epoch = state.epoch
                if not self._held:
                    self._add_histograms(loop)
        if self._held is False:
            self._flush()  # on disk before the next quorum: a successor takes over from it

    def on_validation_end(self, loop: Loop) -> None:
        """Every metric of this validation, once, at the current step."""
        self._metrics(loop, self._metric_steps.at_validation_end(loop))

    def on_epoch_end(self, loop: Loop) -> None:
        """Metrics not logged at this step yet (train_loss without validation), then flush.

        Without a validation at this step, the ``val_*`` values in ``loop.state.metrics``
        are those of an earlier validation, already logged at its step: left out. An epoch
        that the end of a launch cut short logs nothing: the relaunch finishes the epoch and
        logs its metrics at its end, as the uninterrupted run does.
        """
        self._metrics(loop, self._metric_steps.at_epoch_end(loop))
        self._flush()

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        """Remember the failure: the hparams session is not marked finished."""
        self._failed = True

    def on_fit_end(self, loop: Loop) -> None:
        """Mark the hparams session finished (after the run's end), flush and close.

        A launch that ended while the run goes on (``loop.stop_resumable``) leaves the
        session open: the relaunch appends to the same run and finishes it.

        A failed write nobody was told of yet (a flush for a checkpoint) is raised here.
        """
        try:
            if (self._epoch_ran and not self._failed and not loop.stop_resumable
                    and self._writer is not None):
                self._add_session_end()
        finally:
            self._close()
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What was logged at the latest step, to write again after a resume purges it: its
        scalars and, when histograms were logged there, the gradient histograms.

        Flushes the writer (a checkpoint is taken). A failed flush is not raised here, where
        it would fail the checkpoint too, but at this callback's next write or at fit end.
        """
        if self._failure is None:
            try:
                self._flush()
            except LogWriteError:
                self._failure_raised = False
        latest = self._histogram_step == self._latest_step
        return {"step": self._latest_step, "scalars": dict(self._latest),
                "histogram_step": self._histogram_step if latest else -1,
                "gradient_histograms": dict(self._gradient_histograms) if latest else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; the next writer replays those values."""
        self._latest_step = int(state["step"])
        self._latest = {str(tag): float(value) for tag, value in state["scalars"].items()}
        self._histogram_step = int(state.get("histogram_step", -1))  # older checkpoints lack it
        self._gradient_histograms = {str(tag): bytes(value) for tag, value
                                     in state.get("gradient_histograms", {}).items()}
        self._continued = True

    # ------------------------------------------------------------------ inside
    def _metrics(self, loop: Loop, due: dict[str, float]) -> None:
        for tag, value in due.items():
            self._scalar(tag, value, loop.state.step)

    def _add_histograms(self, loop: Loop, gradients: Mapping[str, bytes] | None = None) -> None:
        """Weight and gradient histograms at the current step; with ``gradients`` (a resume
        replaying this step), those serialized gradient summaries instead of ``.grad``."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import histogram

        writer, step = self.writer, loop.state.step
        file_writer, bins = summary_file_writer(writer), writer.default_bins
        kept: dict[str, bytes] = {}
        with self._writing():
            for name, param in loop.unwrapped_model.named_parameters():
                # A sharded parameter (FSDP, tensor parallel): rank 0's shard, so tagged (this
                # rank-0-only callback cannot gather the others').
                tag = f"{name}@rank0-shard" if is_sharded_tensor(param) else name
                file_writer.add_summary(histogram(f"weights/{tag}", _local(param), bins), step)
                if gradients is not None:
                    if name in gradients:
                        file_writer.add_summary(Summary.FromString(gradients[name]), step)
                elif param.grad is not None:
                    summary = histogram(f"gradients/{tag}", _local(param.grad), bins)
                    file_writer.add_summary(summary, step)
                    kept[name] = summary.SerializeToString()
        if gradients is None:
            self._histogram_step, self._gradient_histograms = step, kept

    def _add_graph(self, loop: Loop) -> None:
        model = loop.unwrapped_model
        inputs = model_inputs(loop.state.batch, loop.inputs)
        if inputs is None or inputs[1]:
            warnings.warn("TensorBoard(graph=True): the graph is traced from positional "
                          "inputs only; this batch is a mapping or an unknown type, so no "
                          "graph is logged.", RuntimeWarning, stacklevel=2)
            return
        writer = self.writer
        try:
            with self._writing(), untouched(model, tensors="buffers"), torch.no_grad(), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")  # tracer chatter
                model.eval()
                writer.add_graph(model, inputs[0][0])
        except LogWriteError:  # the trace worked; writing it did not
            raise
        except Exception as error:  # noqa: BLE001 - an untraceable model never stops training
            warnings.warn(f"TensorBoard(graph=True): could not trace the model ({error!r}); "
                          "no graph is logged.", RuntimeWarning, stacklevel=2)

    def _add_session_start(self, loop: Loop) -> None:
        """The hparams plugin's session start: this run's settings, flushed at once."""
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        params = self.hparams if self.hparams is not None else gather_hparams(loop)
        params = {str(key): value if isinstance(value, _Scalar) else repr(value)
                  for key, value in params.items()}
        # Only the session start: an experiment summary in every run directory would make
        # the tab show one run's columns for all (it takes the first it finds); without it
        # the tab gathers the settings of every run and takes the scalars as the metrics.
        _, session_start, _ = hparams_summary(params, {})
        writer = self.writer
        with self._writing():
            summary_file_writer(writer).add_summary(session_start)
            writer.flush()

    def _add_session_end(self) -> None:
        """The hparams plugin's session end: the run finished (status: success)."""
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        _, _, session_end = hparams_summary({}, {})
        writer = self.writer
        with self._writing():
            summary_file_writer(writer).add_summary(session_end)


def _after_files_of(directory: str) -> None:
    """Wait until a new event file's name (its creation second first) sorts after every
    file in ``directory``: TensorBoard's reader reads them in name order, so a writer's
    ``purge_step`` must come after what the writers before it logged."""
    seconds = [int(part) for name in _event_files(directory)
               for part in name.split(".")[3:4] if part.isdigit()]
    while seconds and int(time.time()) <= max(seconds):
        time.sleep(0.05)


def _event_files(directory: str) -> set[str]:
    return {name for name in os.listdir(directory) if name.startswith("events.out.tfevents")}


_quiet: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def _quiet_thread(writer: Any) -> None:
    """Keep the background thread of ``writer``'s event file from printing its own traceback
    when a write fails (a full disk): the thread keeps the error, the writer's next call
    raises it in the main thread, and `TensorBoard` turns it into the one `LogWriteError`
    the user sees. Other threads' exceptions are printed as before."""
    worker = summary_writer_thread(writer)
    if not isinstance(worker, threading.Thread):
        return  # another tensorboard layout: its thread prints as it did
    _quiet.add(worker)
    if getattr(threading.excepthook, "_hookloop_quiet", False):
        return
    previous = threading.excepthook

    def hook(args: Any) -> None:
        if args.thread in _quiet and isinstance(args.exc_value, OSError):
            return  # raised again, named, in the main thread
        previous(args)

    hook._hookloop_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached; a DTensor's local shard (a histogram reads plain values)."""
    tensor = tensor.detach()
    return tensor.to_local() if is_sharded_tensor(tensor) else tensor  # type: ignore[attr-defined]
