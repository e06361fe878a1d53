"""TensorBoard logging: losses, learning rates, metrics, histograms, graph and hyper-parameters."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hookloop.callback import Callback
from hookloop.checks import check_flag, check_int, check_optional_int, check_path
from hookloop.compat import loss_scale, summary_file_writer
from hookloop.errors import ConfigurationError
from hookloop.forward import model_inputs
from hookloop.phase import Phase
from hookloop.untouched import untouched

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from hookloop.loop import Loop

__all__ = ["TensorBoard", "gather_hparams"]

_Scalar = (int, float, str, bool)


def gather_hparams(loop: Loop) -> dict[str, Any]:
    """The run's hyper-parameters as TensorBoard takes them (numbers, strings, booleans).

    The optimizer's class and its first param group's settings (``lr``, ``weight_decay``,
    ``momentum``...), the batch size when ``train_data`` has one, the number of epochs,
    and every callback's ``repr`` and public settings (``1.GradClip.max_norm``...).

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(2, 1)
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [])
        >>> gather_hparams(loop)["optimizer"], gather_hparams(loop)["lr"]
        ('SGD', 0.1)
    """
    optimizer = loop.optimizer
    params: dict[str, Any] = {"optimizer": type(optimizer).__name__}
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    for key, value in group.items():
        if key in ("params", "initial_lr"):
            continue
        if key == "lr":  # the configured rate, not where a scheduler has moved it
            value = group.get("initial_lr", value)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
            for index, item in enumerate(value):
                params[f"{key}_{index}"] = item
        elif isinstance(value, _Scalar):
            params[key] = value
    batch_size = getattr(loop.train_data, "batch_size", None)
    if isinstance(batch_size, int):
        params["batch_size"] = batch_size
    if loop.state.epochs:
        params["epochs"] = loop.state.epochs
    for index, callback in enumerate(loop.callbacks):
        prefix = f"{index}.{type(callback).__name__}"
        params[prefix] = repr(callback)
        for key, value in vars(callback).items():
            if not key.startswith("_") and isinstance(value, _Scalar):
                params[f"{prefix}.{key}"] = value
    return params


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
      ``zero_grad``). Off by default: histograms are slow to write and to load.
    * with ``graph=True``: the model graph, traced from the first training batch in eval
      mode without gradients (modes, BatchNorm statistics and RNG streams are restored).
      A model that cannot be traced gives a warning, never an error.
    * at the run's end (not after an exception, nor at the end of a launch that a signal
      or ``TimeLimit`` ended while the run goes on): hyper-parameters with the final
      metrics, for the HPARAMS tab: ``hparams`` if given, else `gather_hparams` (optimizer,
      its settings, batch size, epochs, callbacks' settings).

    The writer (``torch.utils.tensorboard.SummaryWriter``) is ``self.writer``; other
    callbacks may log through it (images, text...). It is opened at the first epoch of a
    fit (or when ``writer`` is first read), flushed at every epoch end and whenever a
    checkpoint takes this callback's state, and closed at fit end, also after an exception.

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
        hparams: Hyper-parameters to log at fit end (numbers, strings, booleans); None
            gathers them from the loop.
        flush_secs: How often the writer flushes by itself, in seconds.

    Raises:
        ConfigurationError: a bad interval or a non-mapping ``hparams``.

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
        self._metrics_step: dict[str, int] = {}
        self._validated_step = -1  # the step of this fit's latest validation
        self._graph_done = False
        self._histogram_epoch = -1
        # The gradient histograms (serialized summaries) of the latest histogram step: the
        # gradients are gone after zero_grad, so a resume that purges it replays these.
        self._histogram_step = -1
        self._gradient_histograms: dict[str, bytes] = {}
        self._epoch_ran = False
        self._failed = False

    def __repr__(self) -> str:
        return f"TensorBoard({self.log_dir!r}, every_n_steps={self.every_n_steps})"

    # ------------------------------------------------------------------ writer
    @property
    def writer(self) -> SummaryWriter:
        """The ``SummaryWriter`` of this run, for other callbacks to log through.

        Raises:
            RuntimeError: read outside ``fit`` (the writer exists from fit start to fit end).
        """
        if self._writer is None:
            loop = self._loop
            if loop is None or not loop.fitting:
                raise RuntimeError(
                    "TensorBoard.writer exists only during fit (from on_fit_start to "
                    "on_fit_end); read it from a callback's event method.")
            self._open(loop)
        assert self._writer is not None
        return self._writer

    def _open(self, loop: Loop) -> None:
        step = loop.state.step
        os.makedirs(self.log_dir, exist_ok=True)
        earlier = any(name.startswith("events.out.tfevents") for name in os.listdir(self.log_dir))
        purge_step: int | None = None
        replay: dict[str, float] = {}
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
        self._writer = self._writer_class(self.log_dir, purge_step=purge_step,
                                          flush_secs=self.flush_secs)
        if replay:
            self._latest = {}
            for tag, value in replay.items():
                self._scalar(tag, value, step)
        if purge_step == step and self._histogram_step == step:
            self._add_histograms(loop, gradients=self._gradient_histograms)

    def _close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.flush()
            writer.close()

    def _scalar(self, tag: str, value: float, step: int) -> None:
        if step != self._latest_step:
            self._latest_step, self._latest = step, {}
        self._latest[tag] = value
        self.writer.add_scalar(tag, value, step)

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
        self._metrics_step = {}
        self._validated_step = -1
        self._histogram_epoch = -1

    def on_epoch_start(self, loop: Loop) -> None:
        """Open the writer (after a checkpoint restored the step, for purge_step)."""
        self._epoch_ran = True
        if self._writer is None:
            self._open(loop)

    def on_batch_start(self, loop: Loop) -> None:
        """Trace the graph from the first batch, once, when asked."""
        if self.graph and not self._graph_done:
            self._graph_done = True
            self._add_graph(loop)

    def after_step(self, loop: Loop) -> None:
        """Every ``every_n_steps``: loss, learning rates, grad norm, loss scale (one read)."""
        state = loop.state
        step = state.step
        if step % self.every_n_steps == 0 and state.loss is not None:
            tags, values = ["step/loss"], [state.loss.detach()]
            if state.grad_norm is not None:
                tags.append("step/grad_norm")
                values.append(state.grad_norm.detach())
            scale = None if loop.scaler is None else loss_scale(loop.scaler)
            if scale is not None:
                tags.append("step/loss_scale")
                values.append(scale)
            device = values[0].device
            numbers = torch.stack([v.float().reshape(()).to(device) for v in values]).tolist()
            for tag, number in zip(tags, numbers):
                self._scalar(tag, number, step)
            groups = loop.optimizer.param_groups
            for index, group in enumerate(groups):
                self._scalar("step/lr" if len(groups) == 1 else f"step/lr_group{index}",
                             float(group["lr"]), step)
        every = self.histograms_every_n_epochs
        if every is not None and (state.epoch + 1) % every == 0 and self._histogram_epoch != state.epoch:
            total = loop.batches_per_epoch
            # The epoch's last step, when the data has a length; else its first step.
            if total is None or state.batch_idx == total - 1:
                self._histogram_epoch = state.epoch
                self._add_histograms(loop)

    def on_validation_end(self, loop: Loop) -> None:
        """Every metric of this validation, once, at the current step."""
        if loop.phase is Phase.VALIDATE:
            self._validated_step = loop.state.step
            self._metrics(loop, only_new=False)

    def on_epoch_end(self, loop: Loop) -> None:
        """Metrics not logged at this step yet (train_loss without validation), then flush.

        Without a validation at this step, the ``val_*`` values in ``loop.state.metrics``
        are those of an earlier validation, already logged at its step: left out. An epoch
        that the end of a launch cut short logs nothing: the relaunch finishes the epoch and
        logs its metrics at its end, as the uninterrupted run does.
        """
        if not (loop.stop_resumable and not loop.epoch_completed):
            self._metrics(loop, only_new=True,
                          stale_val=self._validated_step != loop.state.step)
        if self._writer is not None:
            self._writer.flush()

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        """Remember the failure: no hyper-parameters for a run that did not finish."""
        self._failed = True

    def on_fit_end(self, loop: Loop) -> None:
        """Hyper-parameters with the final metrics (after the run's end), flush and close.

        A launch that ended while the run goes on (``loop.stop_resumable``) writes none:
        the relaunch appends to the same run and writes them at the run's end."""
        try:
            if self._epoch_ran and not self._failed and not loop.stop_resumable:
                self._add_hparams(loop)
        finally:
            self._close()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What was logged at the latest step, to write again after a resume purges it: its
        scalars and, when histograms were logged there, the gradient histograms. Flushes
        the writer (a checkpoint is taken)."""
        if self._writer is not None:
            self._writer.flush()
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

    # ------------------------------------------------------------------ inside
    def _metrics(self, loop: Loop, *, only_new: bool, stale_val: bool = False) -> None:
        step = loop.state.step
        for name, value in loop.state.metrics.items():
            if only_new and self._metrics_step.get(name) == step:
                continue
            if stale_val and name.startswith("val_"):
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._metrics_step[name] = step
            self._scalar(f"metrics/{name}", float(value), step)

    def _add_histograms(self, loop: Loop, gradients: Mapping[str, bytes] | None = None) -> None:
        """Weight and gradient histograms at the current step; with ``gradients`` (a resume
        replaying this step), those serialized gradient summaries instead of ``.grad``."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import histogram

        writer, step = self.writer, loop.state.step
        file_writer, bins = summary_file_writer(writer), writer.default_bins
        kept: dict[str, bytes] = {}
        for name, param in loop.unwrapped_model.named_parameters():
            file_writer.add_summary(histogram(f"weights/{name}", param.detach(), bins), step)
            if gradients is not None:
                if name in gradients:
                    file_writer.add_summary(Summary.FromString(gradients[name]), step)
            elif param.grad is not None:
                summary = histogram(f"gradients/{name}", param.grad.detach(), bins)
                file_writer.add_summary(summary, step)
                kept[name] = summary.SerializeToString()
        if gradients is None:
            self._histogram_step, self._gradient_histograms = step, kept

    def _add_graph(self, loop: Loop) -> None:
        model = loop.unwrapped_model
        inputs = model_inputs(loop.state.batch)
        if inputs is None or inputs[1]:
            warnings.warn("TensorBoard(graph=True): the graph is traced from positional "
                          "inputs only; this batch is a mapping or an unknown type, so no "
                          "graph is logged.", RuntimeWarning, stacklevel=2)
            return
        try:
            with untouched(model, tensors="buffers"), torch.no_grad(), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")  # tracer chatter
                model.eval()
                self.writer.add_graph(model, inputs[0][0])
        except Exception as error:  # best effort: a graph never stops training
            warnings.warn(f"TensorBoard(graph=True): could not trace the model ({error!r}); "
                          "no graph is logged.", RuntimeWarning, stacklevel=2)

    def _add_hparams(self, loop: Loop) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        metrics = {f"metrics/{name}": float(value) for name, value in loop.state.metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)
                   and math.isfinite(value)}
        if not metrics:  # an HPARAMS entry without metrics shows nothing useful
            return
        params = self.hparams if self.hparams is not None else gather_hparams(loop)
        params = {str(key): value if isinstance(value, _Scalar) else repr(value)
                  for key, value in params.items()}
        writer = self.writer
        for tag, value in metrics.items():  # the metric tags must hold values in this run
            # (a val_* value logged at its validation's step is not logged again here)
            if tag[len("metrics/"):] not in self._metrics_step:
                self._scalar(tag, value, loop.state.step)
        file_writer = summary_file_writer(writer)
        for summary in hparams_summary(params, metrics):
            file_writer.add_summary(summary)
