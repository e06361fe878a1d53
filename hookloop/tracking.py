"""`Tracker`: what the experiment-tracker callbacks (`hookloop.callbacks.WandbLogger`,
`hookloop.callbacks.MLflowLogger`) share: when values are due, the tracker run's identity
across launches, and a tracker that fails without ending training.

A tracker is a remote service (or a library talking to one): its failures (a network
outage, a quota, a crash inside its library) are not the run's. Unlike a local file view
(`TensorBoard`, `CSVLogger`, which raise `hookloop.LogWriteError`), a `Tracker` warns once
with the cause, keeps every value it could not send (in memory and in its checkpointed
state), retries at later sends, and says at fit end what was not sent.
"""

from __future__ import annotations

import enum
import numbers
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hookloop.base.checks import check_int
from hookloop.callback import Callback
from hookloop.checkpoint_uploads import CheckpointUploads, Upload, check_mode
from hookloop.errors import ConfigurationError
from hookloop.scalars import MetricSteps, gather_hparams, read_values, step_due, step_values

if TYPE_CHECKING:
    from collections.abc import Mapping

    from hookloop.loop import Loop

__all__ = ["Row", "Tracker", "model_metadata", "end_reason", "check_plain", "plain_values"]

_PLAIN = (str, int, float, bool, type(None))


def plain_values(label: str, value: Any, *, nested: bool = True) -> Any:
    """``value`` as a tracker can store it: strings, numbers, bools and None (and, with
    ``nested``, lists, tuples and dicts of them with string keys). What has a plain form
    is given it: a NumPy or 0-dim tensor number its Python number, a path its string, an
    enum member its value, a dtype its name (``argparse``'s ``vars(args)`` holds such
    values). Anything else (a function, a model, an ``object()``) is refused: a tracker
    would store its ``repr`` (``<function print at 0x7f...>``), which tells nothing, or fail
    inside the library at the first send.

    Raises:
        ConfigurationError: naming ``label``, the value and the fix.

    Example:
        >>> import pathlib
        >>> plain_values("WandbLogger hparams", {"lr": 0.1, "out": pathlib.Path("runs")})
        {'lr': 0.1, 'out': 'runs'}
        >>> plain_values("WandbLogger hparams", {"f": print})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: WandbLogger hparams['f'] must be a string, ...
    """
    is_dict = isinstance(value, dict)
    converted: dict[Any, Any] = {}
    for key, item in value.items() if is_dict else enumerate(value):
        where = f"{label}[{key!r}]"
        if is_dict and not isinstance(key, str):
            raise ConfigurationError(f"{label} keys must be strings, got {key!r}: write "
                                     f"{{{str(key)!r}: ...}}.")
        if nested and isinstance(item, (list, tuple, dict)):
            converted[key] = plain_values(where, item)
            continue
        converted[key] = _plain(item)
        if converted[key] is _NO_PLAIN_FORM:
            kind = "lists or dicts of them" if nested else "nothing else"
            raise ConfigurationError(
                f"{where} must be a string, a number, a bool or None ({kind}), got {item!r} "
                f"({type(item).__name__}), which the tracker could only store as its repr "
                f"(or not at all). Give a plain value instead, e.g. {_plain_hint(item)}.")
    if is_dict:
        return converted
    return type(value)(converted.values()) if isinstance(value, (list, tuple)) else list(
        converted.values())


def check_plain(label: str, value: Any, *, nested: bool = True) -> None:
    """Refuse what `plain_values` cannot store (naming ``label``, the value and the fix)."""
    plain_values(label, value, nested=nested)


_NO_PLAIN_FORM = object()


def _plain(item: Any) -> Any:
    """The plain form of one value, or `_NO_PLAIN_FORM`."""
    if isinstance(item, _PLAIN):
        return item
    if isinstance(item, enum.Enum):
        return _plain(item.value) if isinstance(item.value, _PLAIN) else item.name
    if isinstance(item, numbers.Number) and hasattr(item, "item"):  # NumPy's numbers
        return item.item()
    if isinstance(item, torch.Tensor):
        return item.item() if item.numel() == 1 else _NO_PLAIN_FORM
    if isinstance(item, torch.dtype):
        return str(item).removeprefix("torch.")
    if isinstance(item, os.PathLike):
        return os.fspath(item)
    return _NO_PLAIN_FORM


def _plain_hint(item: Any) -> str:
    """What to write instead of ``item``: its name for a function or class, else str()."""
    name = getattr(item, "__qualname__", None) or getattr(item, "__name__", None)
    return repr(name) if isinstance(name, str) else "str(value)"


#: One send: ``(step, {tag: value}, unix time in milliseconds)``.
Row = tuple[int, dict[str, float], int]

#: After the n-th failure in a row, that many send points are skipped before the next try
#: (1, 2, 4 ... up to 32): a tracker that hangs on a dead network costs few timeouts.
_MAX_SKIP = 32


def model_metadata(loop: Loop) -> dict[str, Any]:
    """The model's summary as run metadata: its class and its parameter counts.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(3, 2)
        >>> model_metadata(Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), []))
        {'model': 'Linear', 'parameters': 8, 'trainable_parameters': 8}
    """
    model = loop.unwrapped_model
    parameters = list(model.parameters())
    return {"model": type(model).__name__,
            "parameters": sum(parameter.numel() for parameter in parameters),
            "trainable_parameters": sum(parameter.numel() for parameter in parameters
                                        if parameter.requires_grad)}


def end_reason(loop: Loop, exc: BaseException | None) -> tuple[str, str]:
    """``(outcome, reason)`` of the fit that ends: outcome is ``"finished"`` (the run
    ended), ``"suspended"`` (the launch ended, the run goes on), ``"killed"`` (Ctrl-C) or
    ``"failed"`` (an exception); the reason is a sentence with the step."""
    step = loop.state.step
    if isinstance(exc, KeyboardInterrupt):
        return "killed", f"interrupted (KeyboardInterrupt) at step {step}"
    if exc is not None:
        return "failed", f"{type(exc).__name__} at step {step}: {exc}"[:500]
    if loop.stop_resumable:
        return "suspended", (f"the launch ended at step {step} ({loop.stop_reason}); the run "
                             "goes on in the next launch")
    if loop.stop_requested:
        return "finished", f"{loop.stop_reason} (step {step})"
    epochs = loop.state.epochs
    done = "its 1 epoch is done" if epochs == 1 else f"all {epochs} epochs are done"
    return "finished", f"{done} (step {step})"


class Tracker(Callback):
    """Base class of the experiment-tracker callbacks: rank 0 only, nothing per batch.

    What it sends, with TensorBoard's tags, cadence and step numbers (x axis:
    ``loop.state.step``): every ``every_n_steps`` optimizer steps ``step/loss``,
    ``step/lr`` (``step/lr_group{i}``), ``step/grad_norm``, ``step/loss_scale`` (kept on the
    device and read in one go at that step: no host sync on the steps between); every
    metric as ``metrics/<name>`` at each validation end and at each epoch end (see
    `hookloop.scalars.MetricSteps`). The run's settings (``hparams``, else
    `hookloop.scalars.gather_hparams`) go to the tracker as settings once, when the tracker
    run is created; the model summary (`model_metadata`) and, at fit end, the end-of-run
    reason (`end_reason`) as run metadata.

    The tracker run's identity is this callback's state: a relaunch that resumes from a
    checkpoint (``Checkpoint(resume=True)``, a requeue) or a second ``fit`` continues the
    same tracker run, and each step is sent once (a value the killed launch had already
    sent after its checkpoint is not sent again). At fit end the run is closed as finished
    when it ended, as failed after an exception, and left resumable when only the launch
    ended (``loop.stop(resumable=True)``, a signal, `TimeLimit`).

    Failures: every call into the tracker's library is guarded. The first failure of a fit
    is warned once (``RuntimeWarning``, naming the tracker and the cause); the values are
    kept (in ``state_dict``, so in the checkpoint too) and sent again at the next send
    points (every step log, validation end and epoch end; after n failures in a row a few
    are skipped, at most 32), and once more at fit end. A fit that ends with values still
    unsent prints one line saying how many, at which steps, and why. Training is never
    stopped by the tracker.

    A subclass implements `_start`, `_send`, `_send_settings`, `_send_metadata`, `_close`
    and, to count what a killed launch sent after its checkpoint, `_already_sent`.

    Checkpoints (``log_checkpoints``, `hookloop.checkpoint_uploads`): ``"best"`` uploads
    each new best file of the stack's monitoring `hookloop.callbacks.Checkpoint`, ``"all"``
    every rotating and best file, once complete, in a thread (waited for at fit end, before
    the run is closed), each under a name with its step and monitored value
    (``best-step=00000012-val_loss=0.4321``). A name the tracker run holds already is not
    uploaded again: a relaunch that saves the same best again uploads nothing, and uploads
    each one an earlier launch staged and the tracker does not hold. A failed upload is
    warned once and retried later; the fit's end line says what was not uploaded.

    Args:
        every_n_steps: Step interval of the ``step/*`` values.
        hparams: Settings to send (numbers, strings, booleans); None gathers them.
        run_id: Continue this tracker run (else a new one is created, or the one the
            restored state names).
        log_checkpoints: ``"best"``, ``"all"``, or None/False (the default: none).
    """

    rank_zero_only = True
    #: The library the subclass needs, and the extra that installs it (named in errors).
    library: ClassVar[str] = ""
    extra: ClassVar[str] = ""
    #: False when the library holds what it was given in memory until the run is closed
    #: (W&B writes its files in blocks and at finish): what this launch sent then stays in
    #: the state, and a relaunch after a kill sends it again (`_already_sent` filters it).
    durable_sends: ClassVar[bool] = True

    def __init__(self, *, every_n_steps: int = 50, hparams: Mapping[str, Any] | None = None,
                 run_id: str | None = None, log_checkpoints: str | bool | None = None) -> None:
        label = type(self).__name__
        self.log_checkpoints = check_mode(label, log_checkpoints)
        self._uploads = CheckpointUploads(label, self.log_checkpoints, self._upload_checkpoint)
        if hparams is not None and not hasattr(hparams, "items"):
            raise ConfigurationError(f"{label} hparams must be a dict of name -> "
                                     f"number/str/bool or None, got {hparams!r}.")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ConfigurationError(f"{label} run_id must be a non-empty string or None, "
                                     f"got {run_id!r}.")
        self.every_n_steps = check_int(f"{label} every_n_steps", every_n_steps)
        self.hparams = None if hparams is None else dict(hparams)
        if self.hparams is not None:
            self.hparams = plain_values(f"{label} hparams", self.hparams)
        self.run_id = run_id
        self._metric_steps = MetricSteps()
        self._pending: list[Row] = []  # due, not sent yet (sent in order)
        self._sent: dict[str, int] = {}  # per tag, the latest step the tracker has
        self._confirmed: dict[str, int] = {}  # the same, once closed (durable_sends False)
        self._unconfirmed: list[Row] = []  # sent by this launch, not yet closed
        self._settings_sent = False  # the new run's settings and model summary went out
        self._settings_confirmed = False  # ... and the run was closed since
        self._open = False  # a tracker run is open in this process
        self._failures = 0  # failures in a row
        self._skip = 0  # send points to skip before the next try
        self._cause: str | None = None  # the latest failure, in words
        self._warned = False
        self._exception: BaseException | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(every_n_steps={self.every_n_steps})"

    # ------------------------------------------------------------------ for subclasses
    def _import(self) -> None:
        """Import the tracker's library (at setup, not at ``import hookloop``)."""

    def _start(self, loop: Loop, run_id: str | None) -> str:
        """Create a tracker run (``run_id`` None) or continue ``run_id``; return its id."""
        raise NotImplementedError

    def _already_sent(self) -> Mapping[str, int]:
        """For a continued run: per tag, the latest step the tracker holds (``"*"``: every
        tag up to that step)."""
        return {}

    def _send(self, rows: list[Row]) -> None:
        """Send ``rows`` (in step order) to the open run."""
        raise NotImplementedError

    def _send_settings(self, settings: dict[str, Any]) -> None:
        """Send the run's settings (hyper-parameters) to a new run."""

    def _send_metadata(self, metadata: dict[str, Any]) -> None:
        """Send run metadata (the model summary, the end reason)."""

    def _close(self, outcome: str, reason: str) -> None:
        """Close the run: ``outcome`` is one of those `end_reason` gives."""

    def _where(self) -> str:
        """Where the values go, for messages (a project, a tracking URI)."""
        return self.library

    def _upload_checkpoint(self, upload: Upload) -> bool:
        """Upload the checkpoint ``upload.path`` under ``upload.name`` (in a thread); True
        when the tracker holds it for sure now, False when once the run is closed."""
        raise NotImplementedError

    def _logged_checkpoints(self) -> set[str]:
        """For a continued run: the names of the checkpoints it holds."""
        return set()

    def _holds_checkpoint(self, upload: Upload) -> bool:
        """For a continued run: whether it holds all of ``upload`` (staged by a launch that
        ended before the tracker confirmed it)."""
        return upload.name in self._uploads.logged

    # ------------------------------------------------------------------ events
    def setup(self, loop: Loop) -> None:
        """Import the tracker's library; missing, it is a `ConfigurationError` saying how
        to install it."""
        try:
            self._import()
        except ImportError as error:
            raise ConfigurationError(
                f"{type(self).__name__} needs {self.library}, which is not installed "
                f"({error}): pip install 'hookloop[{self.extra}]'.") from error
        if loop.fitting:
            self._uploads.attach(loop)

    def on_fit_start(self, loop: Loop) -> None:
        """Nothing logged in this fit yet; the tracker run opens at the first epoch."""
        self._metric_steps.reset()
        self._failures = self._skip = 0
        self._warned, self._exception = False, None

    def on_epoch_start(self, loop: Loop) -> None:
        """Open (or continue) the tracker run, after a checkpoint restored its identity."""
        if not self._open:
            self._guarded(loop, self._ensure_open)

    def after_step(self, loop: Loop) -> None:
        """Every ``every_n_steps``: the ``step/*`` values, read in one go, then sent."""
        if step_due(loop, self.every_n_steps):
            self._due(loop, read_values(step_values(loop)))
        self._look_for_checkpoints(loop)

    def on_validation_end(self, loop: Loop) -> None:
        """Every metric of this validation, at the current step."""
        self._due(loop, self._metric_steps.at_validation_end(loop))
        self._look_for_checkpoints(loop)

    def on_epoch_end(self, loop: Loop) -> None:
        """Metrics not sent at this step yet (``train_loss`` without validation)."""
        self._due(loop, self._metric_steps.at_epoch_end(loop))
        self._look_for_checkpoints(loop)

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        """Remember the exception: the run is closed as failed (or killed, for Ctrl-C)."""
        self._exception = exc

    def on_fit_end(self, loop: Loop) -> None:
        """Send what is left, the end reason, close the run; say what was not sent."""
        outcome, reason = end_reason(loop, self._exception)
        self._skip = 0
        self._guarded(loop, self._flush)
        self._look_for_checkpoints(loop)
        self._uploads.wait()  # before the run is closed
        if self._open:
            self._skip = 0
            self._guarded(loop, lambda loop: self._send_metadata({"end_reason": reason}))
            self._skip = 0
            if self._guarded(loop, lambda loop: self._close(outcome, reason)):
                self._unconfirmed, self._confirmed = [], dict(self._sent)
                self._settings_confirmed = self._settings_sent
            self._open = False  # a later fit continues the same run id
        if self._pending and _is_main():
            steps = [row[0] for row in self._pending]
            values = sum(len(row[1]) for row in self._pending)
            print(f"hookloop: {type(self).__name__} did not send {values} values (steps "
                  f"{min(steps)} to {max(steps)}) to {self._where()}: {self._cause}. They are "
                  "kept in its state (the checkpoint) and sent when the run continues.",
                  flush=True)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The tracker run's id, what it holds per tag, and the values not sent yet (with
        ``durable_sends`` False: not yet closed)."""
        if self.durable_sends:
            sent, pending, settings = self._sent, self._pending, self._settings_sent
        else:
            sent, pending = self._confirmed, self._unconfirmed + self._pending
            settings = self._settings_confirmed
        return {"run_id": self.run_id, "sent": dict(sent), "settings_sent": settings,
                "pending": [[step, dict(values), stamp] for step, values, stamp in pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned: the next open continues that run."""
        run_id = state["run_id"]
        self.run_id = None if run_id is None else str(run_id)
        self._sent = {str(tag): int(step) for tag, step in state["sent"].items()}
        self._confirmed = dict(self._sent)
        self._settings_sent = self._settings_confirmed = bool(state["settings_sent"])
        self._pending = [(int(step), {str(tag): float(value) for tag, value in values.items()},
                          int(stamp)) for step, values, stamp in state["pending"]]
        self._unconfirmed = []
        self._open = False

    # ------------------------------------------------------------------ inside
    def _look_for_checkpoints(self, loop: Loop) -> None:
        if self.log_checkpoints is not None and self._open and loop.fitting:
            self._uploads.look(loop)

    def _due(self, loop: Loop, values: dict[str, float]) -> None:
        if values:
            self._pending.append((loop.state.step, values, int(time.time() * 1000)))
            self._guarded(loop, self._flush)

    def _ensure_open(self, loop: Loop) -> None:
        if not self._open:
            continued = self.run_id is not None
            self.run_id = self._start(loop, self.run_id)
            self._open = True
            if continued:
                for tag, step in self._already_sent().items():
                    self._sent[tag] = max(self._sent.get(tag, -1), int(step))
                if self.log_checkpoints is not None:
                    self._uploads.logged |= self._logged_checkpoints()
            if self.log_checkpoints is not None:
                self._uploads.resume(self.run_id, self._holds_checkpoint)
        if not self._settings_sent:
            settings = dict(self.hparams) if self.hparams is not None else gather_hparams(loop)
            settings.pop(f"{self.state_key}/run_id", None)  # this run's identity: not a setting
            self._send_settings(settings)
            self._send_metadata(model_metadata(loop))
            self._settings_sent = True

    def _flush(self, loop: Loop) -> None:
        self._ensure_open(loop)
        rows, every = [], self._sent.get("*", -1)  # "*": a step every tag has up to
        for step, values, stamp in self._pending:
            new = {tag: value for tag, value in values.items()
                   if step > max(self._sent.get(tag, -1), every)}
            if new:
                rows.append((step, new, stamp))
        if rows:
            self._send(rows)
            if not self.durable_sends:
                self._unconfirmed.extend(rows)
            for step, values, _ in rows:
                for tag in values:
                    self._sent[tag] = max(self._sent.get(tag, -1), step)
        self._pending = []

    def _guarded(self, loop: Loop, action: Any) -> bool:
        """Run ``action(loop)``; a failure is warned once and retried later. True when it ran."""
        if self._skip > 0:
            self._skip -= 1
            return False
        try:
            action(loop)
        except Exception as error:  # noqa: BLE001 - a tracker's failure never ends training
            self._failures += 1
            self._skip = min(2 ** (self._failures - 1), _MAX_SKIP) - 1
            detail = f": {error}" if str(error) else ""
            self._cause = f"{type(error).__name__}{detail}"[:300]
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"{type(self).__name__}: sending to {self._where()} failed "
                    f"({self._cause}); training goes on, the values are kept and sent again "
                    "later (this is said once per fit; the fit's end line says what was not "
                    "sent).", RuntimeWarning, stacklevel=2)
            return False
        self._failures = 0
        return True


def _is_main() -> bool:
    from hookloop import distributed

    return distributed.is_main()
