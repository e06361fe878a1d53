"""The run's history (and the training loss every n steps) as a CSV file pandas reads back."""

from __future__ import annotations

import contextlib
import csv
import math
import os
from typing import TYPE_CHECKING, Any

import torch

from hookloop.base.checks import check_optional_int, check_path
from hookloop.callback import Callback
from hookloop.errors import LogWriteError

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["CSVLogger"]

#: The leading columns of every file; metric columns follow in order of first appearance.
FIXED = ("kind", "epoch", "step", "loss", "lr")


def _step_of(row: dict[str, str]) -> float:
    try:
        return float(row.get("step") or "nan")
    except ValueError:
        return math.nan


class CSVLogger(Callback):
    """Write ``loop.state.history`` (and the training loss every n steps) to a CSV file.

    Layout (one header line, then one line per row):

    ``kind,epoch,step,loss,lr,<metric>,<metric>,...``

    * ``kind == "history"``: a row of ``loop.state.history`` (one per validation, or per
      epoch without validation data): ``epoch`` (0-based), ``step`` (global step) and its
      metrics (``train_loss``, ``val_loss``, ``val_acc``...); ``loss`` and ``lr`` empty.
    * ``kind == "step"`` (with ``every_n_steps``): every n-th optimizer step, ``loss`` (the
      true loss of the batch that completed the step) and ``lr`` (first param group);
      metric columns empty.

    ``pandas.read_csv(path)`` reads it back; ``df[df.kind == "history"]`` has the values of
    ``pd.DataFrame(loop.state.history)``. A metric that first appears later (a callback
    added on resume) adds a column: the file is then rewritten with the wider header
    (atomically, through a temporary file).

    Rows are written at ``on_epoch_start``, ``on_epoch_end`` and ``on_fit_end``; the step
    losses are kept on the device until then and read together, once per write: no host
    sync per step.

    A new run (step 0) overwrites ``path``; a resumed run (a checkpoint restored this
    callback's state, or ``fit`` called again on the same loop) keeps the rows written up to
    the checkpoint, drops those the interrupted run wrote after it, and appends: no row
    appears twice.

    A row is kept until it is in the file: a write that fails (a full disk) raises
    `hookloop.LogWriteError` naming the file and the cause, and the rows it held stay
    owed: in this callback's state (so in the checkpoint written on the way out) and for
    the next write of this loop. A relaunch with ``Checkpoint(..., resume=True)`` writes
    them, in order, each once: step rows are keyed by ``(epoch, step)``, and history rows
    come from the restored ``loop.state.history``. A line the failed write left half
    written is cut off.

    Args:
        path: The CSV file (its folder is created if missing).
        every_n_steps: Interval of the ``"step"`` rows; None for history rows only.

    Raises:
        ConfigurationError: a bad interval.
        LogWriteError: during fit, the file could not be written.

    Example:
        >>> import os, tempfile, torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
        >>> path = os.path.join(tempfile.mkdtemp(), "log.csv")
        >>> _ = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...          loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...          callbacks=[CSVLogger(path, every_n_steps=2)]).fit(1)
        hookloop: training ended at epoch 1/1, step 4: its 1 epoch is done.
        >>> [line.split(",")[:3] for line in open(path).read().splitlines()]
        [['kind', 'epoch', 'step'], ['step', '0', '2'], ['step', '0', '4'], ['history', '0', '4']]
    """

    rank_zero_only = True

    def __init__(self, path: str | os.PathLike[str], *, every_n_steps: int | None = None) -> None:
        self.path = check_path("CSVLogger path", path)
        self.every_n_steps = check_optional_int("CSVLogger every_n_steps", every_n_steps,
                                                hint="None writes history rows only.")
        self._columns: list[str] = list(FIXED)
        self._rows = 0                 # data rows in the file, or owed to it (pending)
        self._pending: list[dict[str, Any]] = []
        self._steps: list[tuple[int, int, torch.Tensor, float]] = []  # not yet read
        self._last_history: tuple[int, int] | None = None  # (epoch, step) of the newest row
        self._loop: Loop | None = None
        self._restored = False
        self._opened = False
        self._damaged = False  # a failed write may have left part of a row after _rows
        self._failed = False  # a write of this fit failed (the fit is ending because of it)
        # None: writes as usual. True/False: a replica group's writer turn under
        # FaultTolerance (see `hold_writes`): held, the rows are counted as the writer's.
        self._held: bool | None = None

    def __repr__(self) -> str:
        every = "" if self.every_n_steps is None else f", every_n_steps={self.every_n_steps}"
        return f"CSVLogger({self.path!r}{every})"

    def hold_writes(self, loop: Loop, held: bool) -> None:
        """Give this step's writing to another process (``held``), or take it (the replica
        group that writes this step's rows under `FaultTolerance`, which calls this after
        each step's commit, once every group of the step's quorum has finished the steps
        before).

        Every group builds the same rows. Held, the rows of the steps before are the
        writer's, in the file by now: counted, not kept. Taking the turn cuts the file back
        to the rows counted (what a writer that died wrote of its last step, whole or half,
        goes) and appends this group's own rows from there. The writer writes after every
        step, so a writer that dies loses nothing its successor cannot write again.
        """
        was, self._held = self._held, held
        if held and was is None:
            return  # the first word (at setup): what is owed stays owed
        if held:
            self._rows += len(self._keyed(self._pending + self._read_steps()))
            history = self._new_history(loop)
            self._rows += len(history)
            if history:
                self._last_history = (int(history[-1]["epoch"]), int(history[-1]["step"]))
            self._pending, self._opened = [], False
        elif was is not False:
            self._restored = True  # the file holds the `_rows` rows counted: cut back to them
            self._flush(loop)

    # ------------------------------------------------------------------ events
    def on_fit_start(self, loop: Loop) -> None:
        """Note whether this fit continues the previous one of the same loop."""
        self._opened = self._failed = False
        if self._loop is not loop and not self._restored:
            self._columns, self._rows, self._pending, self._steps = list(FIXED), 0, [], []
            self._last_history = None
        self._loop = loop

    def on_epoch_start(self, loop: Loop) -> None:
        """Open the file (a checkpoint has been restored by now) and write what is owed."""
        if not self._held:
            self._flush(loop)

    @property
    def _silent_events(self) -> tuple[str, ...]:
        """Without ``every_n_steps``, nothing to do after a step: not called there."""
        own = type(self).after_step is CSVLogger.after_step  # a subclass's override is called
        return ("after_step",) if self.every_n_steps is None and own else ()

    def after_step(self, loop: Loop) -> None:
        """Every ``every_n_steps`` steps, keep the loss tensor (read at the next write);
        another step returns at once (one modulo)."""
        state, every = loop.state, self.every_n_steps
        if every is not None and state.step % every == 0 and state.loss is not None:
            lr = loop.optimizer.param_groups[0]["lr"] if loop.optimizer.param_groups else math.nan
            self._steps.append((state.epoch, state.step, state.loss.detach(), float(lr)))
        if self._held is False:
            self._flush(loop)  # in the file before the next quorum: see `hold_writes`

    def on_epoch_end(self, loop: Loop) -> None:
        """Write the epoch's step rows and new history rows."""
        if not self._held:
            self._flush(loop)

    def on_fit_end(self, loop: Loop) -> None:
        """Write what is left (a history row recorded after on_epoch_end).

        Not after a failed write of this fit: the disk failed moments ago, and the rows are
        owed to the next fit or relaunch (a checkpoint taken on the way out holds them).
        """
        if self._failed or self._held:
            return
        if self._opened or self._steps or self._pending or self._new_history(loop):
            self._flush(loop)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Rows in the file so far, the rows owed to it, the columns and the newest history key.

        Step losses kept on the device are read here (once per checkpoint).
        """
        self._pending = self._keyed(self._pending + self._read_steps())
        last = self._last_history
        return {"rows": self._rows, "pending": [dict(row) for row in self._pending],
                "columns": list(self._columns),
                "last_history": None if last is None else list(last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned: the next write trims and appends."""
        self._rows = int(state["rows"])
        self._pending = [dict(row) for row in state["pending"]]
        self._steps = []
        self._columns = list(state["columns"])
        last = state["last_history"]
        self._last_history = None if last is None else (int(last[0]), int(last[1]))
        self._restored = True

    # ------------------------------------------------------------------ inside
    def _read_steps(self) -> list[dict[str, Any]]:
        """The kept step losses as rows, read from the device in one go."""
        if not self._steps:
            return []
        values = torch.stack([loss.float().reshape(()).to(self._steps[0][2].device)
                              for _, _, loss, _ in self._steps]).tolist()
        rows = [{"kind": "step", "epoch": epoch, "step": step, "loss": value, "lr": lr}
                for (epoch, step, _, lr), value in zip(self._steps, values)]
        self._steps = []
        return rows

    def _new_history(self, loop: Loop) -> list[dict[str, Any]]:
        last = self._last_history
        return [row for row in loop.state.history
                if last is None or (int(row["epoch"]), int(row["step"])) > last]

    def _flush(self, loop: Loop) -> None:
        """Write the pending step rows and the new history rows, in step order.

        A row stays owed (pending, or after ``_last_history``) until the write that holds
        it has returned: a write that fails (a full disk) loses nothing, and the rows it
        may have left half written are cut off at the next write, which starts again from
        the ``_rows`` complete rows before it.
        """
        if not self._opened:
            self._open(loop)
        self._pending = self._keyed(self._pending + self._read_steps())
        history = self._new_history(loop)
        rows = self._pending + [{"kind": "history", **row} for row in history]
        if not rows:
            return
        rows.sort(key=lambda row: (row["step"], row["kind"] == "history"))
        columns = list(self._columns)
        for key in (key for row in rows for key in row):
            if key not in columns:
                columns.append(key)
        try:
            if columns != self._columns or self._damaged:
                # a wider header, or a failed append that may have left a partial line
                self._rewrite(self._read_file()[:self._rows], columns)
            with open(self.path, "a", newline="", encoding="utf-8") as handle:
                self._damaged = True  # until the rows are all in the file
                csv.DictWriter(handle, columns, restval="").writerows(rows)
        except OSError as error:
            self._failed = True
            raise LogWriteError.of("CSVLogger", self.path, error) from error
        self._damaged = False
        self._columns = columns
        self._rows += len(rows)
        self._pending = []
        if history:
            self._last_history = (int(history[-1]["epoch"]), int(history[-1]["step"]))

    @staticmethod
    def _keyed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Step rows once per ``(epoch, step)``: the latest kept, in order."""
        return list({(row["epoch"], row["step"]): row for row in rows}.values())

    def _open(self, loop: Loop) -> None:
        """A new run starts the file; a continued one trims it to the rows of the run."""
        directory = os.path.dirname(self.path)
        try:
            if directory:
                os.makedirs(directory, exist_ok=True)
            existing = self._read_file()
        except OSError as error:
            self._failed = True
            raise LogWriteError.of("CSVLogger", self.path, error) from error
        columns = list(self._columns)
        if self._restored or (loop is self._loop and self._rows):
            kept = existing[:self._rows]  # what the interrupted run wrote after its checkpoint goes
        elif loop.state.step > 0:  # resumed without this callback's state: trim by step
            kept = [row for row in existing if _step_of(row) <= loop.state.step]
        else:  # a new run
            kept, columns = [], list(FIXED)
        for row in kept:
            for key in row:
                if key not in columns:
                    columns.append(key)
        try:
            self._rewrite(kept, columns)
        except OSError as error:  # nothing changed: the next write tries again
            self._failed = True
            raise LogWriteError.of("CSVLogger", self.path, error) from error
        self._columns, self._rows, self._damaged = columns, len(kept), False
        self._opened, self._restored = True, False

    def _read_file(self) -> list[dict[str, str]]:
        try:
            with open(self.path, newline="", encoding="utf-8") as handle:
                return list(csv.DictReader(handle))
        except FileNotFoundError:
            return []

    def _rewrite(self, rows: list[dict[str, Any]], columns: list[str]) -> None:
        """The file holds ``rows`` under the header ``columns``, replaced atomically."""
        temporary = self.path + ".tmp"
        try:
            with open(temporary, "w", newline="", encoding="utf-8") as handle:
                writer = csv.DictWriter(handle, columns, restval="")
                writer.writeheader()
                writer.writerows(rows)
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(temporary)
            raise
