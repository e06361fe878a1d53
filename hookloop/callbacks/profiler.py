"""Where the time of a fit goes: each callback at each event, and the loop's own phases."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.base.checks import check_console, check_flag
from hookloop.callback import Callback

if TYPE_CHECKING:
    from rich.console import Console

    from hookloop.loop import Loop

__all__ = ["Profiler"]

#: The loop's phases, in the order of a batch; "other" is the rest of the fit's wall time.
PHASES = ("data", "forward", "backward", "step", "validation", "other")
LOOP = "(loop)"


class Profiler(Callback):
    """Time every callback at every event, and the loop's phases; print a table at fit end.

    Callbacks are timed by wrapping each dispatched method (``loop.handler_wrapper``):
    nothing changes in the loop, and without a Profiler there is no cost at all. The loop's
    own phases are measured between events, minus the time callbacks spent in between:

    * ``data``: from the end of a batch (or the epoch start) to the next ``on_batch_start``:
      fetching the batch and moving it to the device;
    * ``forward``: forward and loss; ``backward``: ``loss.backward()``;
    * ``step``: from ``after_backward`` to ``on_batch_end``: the optimizer step and
      ``zero_grad`` (a callback that routes the step, such as AMP, has it in its
      ``optimizer_step`` row instead);
    * ``validation``: the validation pass without its callbacks;
    * ``other``: the rest of the fit (setup, epoch ends, reading the epoch losses).

    On GPUs the work is asynchronous: without synchronisation, time shows up where the
    host waits (often ``step`` or the next ``.item()``). ``sync_cuda=True`` synchronises the
    device at every boundary for exact attribution, at a cost; the default adds no sync.

    The table is printed at the Profiler's ``on_fit_end`` (put it last to include every
    callback's ``on_fit_end``); `report` returns the same rows as dicts. Under DDP every
    rank measures its own run, and only rank 0 prints its table (one table, not one per
    process); on another rank, `report` or `print_report` give that rank's figures.

    Args:
        sync_cuda: Synchronise CUDA at every measured boundary (exact, slower).
        console: The ``rich.console.Console`` to print on; None makes one on stdout.
        print_table: Print the table at fit end (on rank 0 only); False only collects
            (see `report`).

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> from hookloop.callbacks import GradClip
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
        >>> profiler = Profiler(print_table=False)
        >>> _ = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...          loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...          callbacks=[GradClip(1.0), profiler]).fit(1)
        hookloop: training ended at epoch 1/1, step 4: its 1 epoch is done.
        >>> [(row["name"], row["calls"]) for row in profiler.report()
        ...  if row["event"] == "before_step"]
        [('GradClip', 4)]
    """

    def __init__(self, *, sync_cuda: bool = False, console: Console | None = None,
                 print_table: bool = True) -> None:
        self.sync_cuda = check_flag("Profiler sync_cuda", sync_cuda)
        self.console = check_console("Profiler", console)
        self.print_table = check_flag("Profiler print_table", print_table)
        self._cells: dict[tuple[int, str], list[float]] = {}
        self._labels: dict[int, str] = {}
        self._callback_time = [0.0]
        self._phases: dict[str, list[float]] = {}
        self._open: tuple[str, float, float] | None = None
        self._start = self._end = 0.0
        self._device: torch.device | None = None

    def __repr__(self) -> str:
        return f"Profiler(sync_cuda={self.sync_cuda})"

    # ------------------------------------------------------------------ timing
    def _sync(self) -> None:
        if self.sync_cuda and self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _wrap(self, callback: Callback, event: str, method: Callable[..., Any]) -> Callable[..., Any]:
        if callback is self:  # its own markers are measurement, not a cost of the stack
            return method
        cell = self._cells.setdefault((id(callback), event), [0.0, 0])
        spent = self._callback_time
        clock, sync = time.perf_counter, self._sync

        def timed(*args: Any, **kwargs: Any) -> Any:
            sync()
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                sync()
                elapsed = clock() - start
                cell[0] += elapsed
                cell[1] += 1
                spent[0] += elapsed

        timed.__self__ = callback  # type: ignore[attr-defined]  # read by error notes
        timed.__name__ = event
        timed.__wrapped__ = method  # type: ignore[attr-defined]
        return timed

    def _mark(self, phase: str | None) -> None:
        """Close the open phase (if any) and open ``phase`` (None: open nothing)."""
        self._sync()
        now, spent = time.perf_counter(), self._callback_time[0]
        if self._open is not None:
            name, start, spent_then = self._open
            cell = self._phases.setdefault(name, [0.0, 0])
            cell[0] += max(0.0, (now - start) - (spent - spent_then))
            cell[1] += 1
        self._open = None if phase is None else (phase, now, spent)

    # ------------------------------------------------------------------ events
    def setup(self, loop: Loop) -> None:
        """In a fit: wrap every dispatched method of the stack with a timer."""
        if not loop.fitting:
            return
        self._cells, self._phases, self._callback_time = {}, {}, [0.0]
        self._device = loop.device
        counts: dict[str, int] = {}
        for callback in loop.callbacks:
            label = callback.name or type(callback).__name__
            counts[label] = counts.get(label, 0) + 1
        self._labels = {}
        for index, callback in enumerate(loop.callbacks):
            label = callback.name or type(callback).__name__
            if counts[label] > 1:
                label = f"{label}[{index}]"
            self._labels[id(callback)] = label
        loop.handler_wrapper = self._wrap
        self._open = None
        self._start = self._end = time.perf_counter()

    def on_epoch_start(self, loop: Loop) -> None:
        self._mark("data")

    def on_batch_start(self, loop: Loop) -> None:
        self._mark("forward")

    def after_forward(self, loop: Loop) -> None:
        self._mark("backward")

    def after_backward(self, loop: Loop) -> None:
        self._mark("step")

    def on_batch_end(self, loop: Loop) -> None:
        self._mark("data")

    def on_validation_start(self, loop: Loop) -> None:
        # The end of the training pass (StopIteration, the epoch loss read) goes to "other".
        self._open = None
        self._mark("validation")

    def on_validation_end(self, loop: Loop) -> None:
        self._mark(None)

    def on_epoch_end(self, loop: Loop) -> None:
        # Without validation, the end of the training pass goes to "other".
        self._open = None

    def on_fit_end(self, loop: Loop) -> None:
        """Stop wrapping, and print the table (rank 0 only: each rank measures, one prints)."""
        self._mark(None)
        self._sync()
        self._end = time.perf_counter()
        loop.handler_wrapper = None
        if self.print_table and distributed.is_main():
            self.print_report()

    # ------------------------------------------------------------------ report
    def report(self) -> list[dict[str, Any]]:
        """Rows ``{"name", "event", "calls", "seconds", "share"}``, slowest first.

        ``name`` is a callback's class name (its ``name`` if set; ``[index]`` added when a
        class appears twice) or ``"(loop)"`` for the phases; ``share`` is the fraction of
        the fit's wall time (setup to the Profiler's ``on_fit_end``).
        """
        rows: list[dict[str, Any]] = []
        for (callback_id, event), (seconds, calls) in self._cells.items():
            if calls:
                rows.append({"name": self._labels.get(callback_id, "?"), "event": event,
                             "calls": int(calls), "seconds": seconds})
        measured = sum(row["seconds"] for row in rows)
        for phase in PHASES[:-1]:
            if phase in self._phases:
                seconds, calls = self._phases[phase]
                measured += seconds
                rows.append({"name": LOOP, "event": phase, "calls": int(calls), "seconds": seconds})
        total = max(self._end - self._start, measured)
        rows.append({"name": LOOP, "event": "other", "calls": 1, "seconds": total - measured})
        for row in rows:
            row["share"] = row["seconds"] / total if total > 0 else 0.0
        rows.sort(key=lambda row: row["seconds"], reverse=True)
        return rows

    def print_report(self) -> None:
        """Print `report` as a rich table."""
        from rich.console import Console
        from rich.table import Table

        rows = self.report()
        total = sum(row["seconds"] for row in rows)
        table = Table(title=f"hookloop profile: {total:.3f} s of fit wall time")
        table.add_column("callback")
        table.add_column("event")
        table.add_column("calls", justify="right")
        table.add_column("total", justify="right")
        table.add_column("per call", justify="right")
        table.add_column("share", justify="right")
        for row in rows:
            per_call = row["seconds"] / max(row["calls"], 1)
            table.add_row(row["name"], row["event"], str(row["calls"]),
                          f"{row['seconds'] * 1e3:.1f} ms", f"{per_call * 1e6:.0f} us",
                          f"{row['share']:.1%}")
        console = self.console if self.console is not None else Console()
        console.print(table)
