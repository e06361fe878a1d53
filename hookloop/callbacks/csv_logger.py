"""The run's history (and the training loss every n steps) as a CSV file pandas reads back."""

from __future__ import annotations

import csv
import math
import os
from typing import TYPE_CHECKING, Any

import torch

from hookloop.callback import Callback
from hookloop.checks import check_optional_int, check_path

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

    Args:
        path: The CSV file (its folder is created if missing).
        every_n_steps: Interval of the ``"step"`` rows; None for history rows only.

    Raises:
        ConfigurationError: a bad interval.

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

    def __repr__(self) -> str:
        every = "" if self.every_n_steps is None else f", every_n_steps={self.every_n_steps}"
        return f"CSVLogger({self.path!r}{every})"

    # ------------------------------------------------------------------ events
    def on_fit_start(self, loop: Loop) -> None:
        """Note whether this fit continues the previous one of the same loop."""
        self._opened = False
        if self._loop is not loop and not self._restored:
            self._columns, self._rows, self._pending, self._steps = list(FIXED), 0, [], []
            self._last_history = None
        self._loop = loop

    def on_epoch_start(self, loop: Loop) -> None:
        """Open the file (a checkpoint has been restored by now) and write what is owed."""
        self._flush(loop)

    def after_step(self, loop: Loop) -> None:
        """Every ``every_n_steps`` steps, keep the loss tensor (read at the next write)."""
        state = loop.state
        if self.every_n_steps is not None and state.step % self.every_n_steps == 0 \
                and state.loss is not None:
            lr = loop.optimizer.param_groups[0]["lr"] if loop.optimizer.param_groups else math.nan
            self._steps.append((state.epoch, state.step, state.loss.detach(), float(lr)))

    def on_epoch_end(self, loop: Loop) -> None:
        """Write the epoch's step rows and new history rows."""
        self._flush(loop)

    def on_fit_end(self, loop: Loop) -> None:
        """Write what is left (a history row recorded after on_epoch_end)."""
        if self._opened or self._steps or self._new_history(loop):
            self._flush(loop)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Rows in the file so far, the rows owed to it, the columns and the newest history key.

        Step losses kept on the device are read here (once per checkpoint).
        """
        self._pending = self._pending + self._read_steps()
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
        if not self._opened:
            self._open(loop)
        rows = self._pending + self._read_steps()
        self._pending = []
        history = self._new_history(loop)
        for row in history:
            rows.append({"kind": "history", **row})
        if history:
            self._last_history = (int(history[-1]["epoch"]), int(history[-1]["step"]))
        if not rows:
            return
        rows.sort(key=lambda row: (row["step"], row["kind"] == "history"))
        new = [key for row in rows for key in row if key not in self._columns]
        for key in dict.fromkeys(new):
            self._columns.append(key)
        if new:
            self._rewrite(self._read_file())
        with open(self.path, "a", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, self._columns, restval="")
            writer.writerows(rows)
        self._rows += len(rows)

    def _open(self, loop: Loop) -> None:
        """A new run starts the file; a continued one trims it to the rows of the run."""
        self._opened = True
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        existing = self._read_file()
        if self._restored or (loop is self._loop and self._rows):
            kept = existing[:self._rows]  # what the interrupted run wrote after its checkpoint goes
        elif loop.state.step > 0:  # resumed without this callback's state: trim by step
            kept = [row for row in existing if _step_of(row) <= loop.state.step]
        else:  # a new run
            kept, self._columns = [], list(FIXED)
        self._restored = False
        for row in kept:
            for key in row:
                if key not in self._columns:
                    self._columns.append(key)
        self._rows = len(kept)
        self._rewrite(kept)

    def _read_file(self) -> list[dict[str, str]]:
        try:
            with open(self.path, newline="", encoding="utf-8") as handle:
                return list(csv.DictReader(handle))
        except FileNotFoundError:
            return []

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        temporary = self.path + ".tmp"
        with open(temporary, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, self._columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(temporary, self.path)
