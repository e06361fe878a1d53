"""A rich progress display, or one plain line per epoch when the output is not a terminal."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from hookloop import distributed
from hookloop.base.checks import check_console, check_flag, check_number
from hookloop.base.phase import Phase
from hookloop.callback import Callback
from hookloop.engine.data import length_of
from hookloop.engine.stateful import is_learning_rate

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from hookloop.loop import Loop

__all__ = ["ProgressBar", "format_number"]

#: The bars' width range: they take what the shown columns leave, within these bounds.
BAR_WIDTH = (20, 40)
#: The role of a callback whose first batches compile the model (`Compile`): the display
#: says so during them instead of showing a speed.
COMPILES = "compiles"
COMPILING = "compiling the model…"


def _remaining_column() -> Any:
    """A column of the time left at the task's own pace: its elapsed time per unit done
    (since the task started) times the units left. rich's ``TimeRemainingColumn`` needs
    several updates within its window, so a bar updated once per epoch (the epochs bar)
    showed ``-:--:--`` after every epoch."""
    from datetime import timedelta

    from rich.progress import ProgressColumn
    from rich.text import Text

    class Remaining(ProgressColumn):
        def render(self, task: Any) -> Text:
            done = task.completed - task.fields.get("done_before", 0)
            if task.fields.get("stopped"):  # a fit that stopped early has no time left to show
                text = ""
            elif task.total is not None and task.completed >= task.total:
                text = "0:00:00"
            elif task.total is None or done <= 0 or not task.elapsed:
                text = "-:--:--"
            else:
                left = task.elapsed / done * (task.total - task.completed)
                text = str(timedelta(seconds=int(left)))
            return Text(text, style="progress.remaining")

    return Remaining()


def _eta_label_column() -> Any:
    """The ETA's label: ``eta``, or ``stopped`` on a bar a fit left unfinished (an early
    stop, ``max_steps``), whose last frame stays on the screen: an ETA there was stale."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Label(ProgressColumn):
        def render(self, task: Any) -> Text:
            return Text("stopped" if task.fields.get("stopped") else "eta")

    from rich.table import Column

    return Label(table_column=Column(justify="right"))  # "    eta" under "stopped"


def _display(console: Console, refresh_per_second: float) -> Progress:
    """A rich ``Progress`` whose columns fit the console's width at every refresh.

    Columns are dropped, least useful first (the learning rate, the speed, the elapsed time,
    the ETA, the loss), until the row fits with a bar of at least ``BAR_WIDTH[0]``
    characters; the bar then takes the room left, up to ``BAR_WIDTH[1]``. A narrow terminal
    shows fewer columns, never a squeezed bar or cut times (``0:00:…``).
    """
    from rich.measure import Measurement
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = BarColumn(bar_width=BAR_WIDTH[0])
    head = (TextColumn("[bold]{task.description}"), bar, MofNCompleteColumn())
    elapsed, eta = (TimeElapsedColumn(),), (_eta_label_column(), _remaining_column())
    loss, lr, speed = (TextColumn(f"{{task.fields[{name}]}}") for name in ("loss", "lr", "speed"))
    layouts = [head + elapsed + eta + (loss, lr, speed), head + elapsed + eta + (loss, speed),
               head + elapsed + eta + (loss,), head + eta + (loss,), head + (loss,), head]

    class Display(Progress):
        def make_tasks_table(self, tasks: Any) -> Any:
            tasks = list(tasks)
            width = console.width  # (self.console does not exist yet when Live first renders)
            unbounded = console.options.update(max_width=10_000)  # measure, don't clamp
            bar.bar_width = BAR_WIDTH[0]
            for columns in layouts:
                self.columns = columns
                needed = Measurement.get(console, unbounded,
                                         super().make_tasks_table(tasks)).maximum
                if needed <= width:
                    break
            bar.bar_width = max(BAR_WIDTH[0], min(BAR_WIDTH[1], BAR_WIDTH[0] + width - needed))
            return super().make_tasks_table(tasks)

        def add_task(self, description: str, *args: Any, **fields: Any) -> TaskID:
            for name in ("loss", "lr", "speed"):
                fields.setdefault(name, "")
            fields.setdefault("done_before", fields.get("completed", 0))
            return super().add_task(description, *args, **fields)

    return Display(*layouts[0], console=console, refresh_per_second=refresh_per_second)


def format_number(value: float) -> str:
    """A metric as people read it: four significant digits (whole numbers from 1000 on),
    scientific notation below 0.001 and from a million.

    Example:
        >>> format_number(0.123456), format_number(1.0986), format_number(1221.1774)
        ('0.1235', '1.099', '1221')
        >>> format_number(3e-06), format_number(123456.7), format_number(2.5e7)
        ('3.000e-06', '123457', '2.500e+07')
    """
    if value != value or math.isinf(value):
        return str(value)
    magnitude = abs(value)
    if value != 0 and (magnitude >= 1e6 or magnitude < 1e-3):
        return f"{value:.3e}"
    text = f"{value:#.4g}"  # '#' keeps the trailing zeros: 0.5000, 2.000
    if magnitude >= 999.95 or "e" in text:
        return f"{value:.0f}"
    return text.rstrip(".")


class ProgressBar(Callback):
    """Show training progress with rich (rank 0 only).

    In a terminal (or a notebook): an epoch bar, a batch bar with the loss of the latest
    batch, the learning rate, speed (samples/s) and ETA, a validation bar during
    validation, and one row of a metrics table per epoch, printed above the bars. Data
    without a length shows a counter instead of a bar. The bars fit the console's width:
    on a narrow one (80 columns) the columns that do not fit are dropped (the learning
    rate, the speed, then the elapsed time...), never the bar (at least 20 characters) or
    part of a time; a metrics table too wide is printed as a plain line.

    When the output is not a terminal (CI, a log file, SLURM): one plain line per epoch,
    without carriage returns or colours, plus a progress line every ``plain_every_s``
    seconds inside long epochs so a log never goes silent.

    Validation metrics (``val_*``) are shown once per validation: in the epoch's row or
    line when the validation ran at the epoch's end, else (``val_every_n_steps``) in a
    line of their own printed right after that validation; an epoch end that did not
    validate shows only the other metrics, as ``loop.state.history`` records them.

    One throughput figure: with a `ThroughputMonitor` in the stack, the batch bar's speed
    and the epoch's line show its ``samples_per_s`` (the latest interval's, all ranks),
    and nothing of the bar's own; without one, the bar's own count (samples of all ranks
    since the epoch's start, per second). Numbers have about four significant digits
    (`format_number`). While `Compile` compiles the model (the first training and
    validation batches of the first fit, minutes on a CPU), the bars say
    ``compiling the model…`` and no speed; plain output prints a line when it starts and
    one when the first batch is done, with the time it took. Lines printed above the bars
    (a metrics line too wide for a table row, a validation's line) wrap between two
    ``name value`` pairs, never inside one. The ETA of each bar is its own pace so far
    (also the epochs bar's, once an epoch is done).

    The shown loss is read from the device at most ``refresh_per_second`` times a second
    (time-throttled), never on every batch: no sync per batch. The bars are stopped at
    ``on_exception``, before the traceback is printed, so it stays readable.

    Args:
        console: The ``rich.console.Console`` to draw on; None makes one on stdout.
        terminal: Force bars (True) or plain lines (False); None asks the console (bars
            in a terminal or a Jupyter notebook).
        refresh_per_second: How often the bars and the shown loss are refreshed.
        plain_every_s: In plain mode, seconds between progress lines inside an epoch.

    Raises:
        ConfigurationError: a non-positive rate or interval.

    Example:
        >>> import io, torch
        >>> from rich.console import Console
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
        >>> console = Console(file=io.StringIO(), force_terminal=False, width=100)
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[ProgressBar(console=console)])
        >>> _ = loop.fit(2)
        hookloop: training ended at epoch 2/2, step 8: all 2 epochs are done.
        >>> console.file.getvalue().splitlines()[1].startswith("epoch 2/2  step 8  train_loss")
        True
    """

    rank_zero_only = True

    def __init__(self, *, console: Console | None = None, terminal: bool | None = None,
                 refresh_per_second: float = 4.0, plain_every_s: float = 60.0) -> None:
        self.refresh_per_second = check_number("ProgressBar refresh_per_second",
                                               refresh_per_second, above=0)
        self.plain_every_s = check_number("ProgressBar plain_every_s", plain_every_s, above=0)
        self.console = check_console("ProgressBar", console)
        if terminal is not None:
            check_flag("ProgressBar terminal", terminal)
        self.terminal = terminal
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._columns: list[str] | None = None
        self._bars = False
        self._next_refresh = 0.0
        self._epoch_start = 0.0
        self._speed_start = 0.0  # the epoch's start, or the end of the compiling batch
        self._samples = 0
        self._batches = 0
        self._countdown = 1  # batch ends until the clock is read again (`_next_read`)
        self._last_read = (0.0, -1)  # (time, batches) at the latest clock read: the pace
        self._val_batches = 0
        self._validated_step = -1  # the step of a validation not shown yet
        self._after_validation = False  # the next on_batch_end ends the batch that validated
        self._train_batch_idx = 0  # the training batch a validation inside the epoch followed
        self._compiling = False  # until the fit's first training batch has run (Compile)
        self._compiled = False  # this bar's loop was compiled in an earlier fit already
        self._warm_up_start = 0.0

    def __repr__(self) -> str:
        return "ProgressBar()"

    # ------------------------------------------------------------------ events
    def on_fit_start(self, loop: Loop) -> None:
        """Pick bars or plain lines and start the display."""
        from rich.console import Console

        if self.console is None:
            self.console = Console()
        if self.terminal is None:  # rich's is_terminal is False in Jupyter, which shows bars
            self._bars = self.console.is_terminal or self.console.is_jupyter
        else:
            self._bars = bool(self.terminal)
        self._columns = None
        self._tasks = {}
        self._validated_step, self._after_validation = -1, False
        self._compiling = not self._compiled and any(
            COMPILES in callback.roles for callback in loop.callbacks)
        self._warm_up_start = time.perf_counter()
        if self._bars:
            self._progress = _display(self.console, self.refresh_per_second)
            self._progress.start()
            state = loop.state
            self._tasks["epoch"] = self._progress.add_task(
                "epochs", total=state.epochs, completed=state.epoch,
                loss=COMPILING if self._compiling else "")
        elif self._compiling:
            self._print(f"{COMPILING[:-1]} (torch.compile): the first training and validation "
                        "batches take longer")

    def on_epoch_start(self, loop: Loop) -> None:
        """Reset the batch bar and the speed clock."""
        self._epoch_start = self._speed_start = time.perf_counter()
        self._next_refresh = self._epoch_start + (0.0 if self._bars else self.plain_every_s)
        self._samples = self._batches = 0
        self._countdown, self._last_read = 1, (self._epoch_start, -1)  # no pace yet
        if self._progress is not None:
            state = loop.state
            description = f"epoch {state.epoch + 1}/{state.epochs}"
            self._progress.update(self._tasks["epoch"], completed=state.epoch)
            self._task("train", description, loop.batches_per_epoch)
            if self._compiling:
                self._progress.update(self._tasks["train"], loss=COMPILING)

    def on_batch_end(self, loop: Loop) -> None:
        """Count samples; at most ``refresh_per_second`` times a second, read and show the loss.

        A quiet batch only counts: the clock is read every few batch ends (`_next_read`), so
        a fast step pays no clock read, formatting or rich call between two refreshes.

        A validation inside the epoch (``val_every_n_steps``) gets its own line of
        ``val_*`` metrics once it is known not to be at the epoch's last batch: at once when
        the data has a length, else at the next batch (the epoch's row shows the others).
        """
        state = loop.state
        self._samples += state.batch_size
        self._batches = state.batch_idx + 1
        self._countdown -= 1
        if self._countdown <= 0:
            self._refresh(loop)

    def _refresh(self, loop: Loop) -> None:
        """The clock's turn (or a validation's line to print): show what is due."""
        batch_idx, ended_validating = loop.state.batch_idx, self._after_validation
        if ended_validating:  # the validation's batches moved state.batch_idx
            batch_idx, self._after_validation = self._train_batch_idx, False
        if self._validated_step >= 0:
            total = loop.batches_per_epoch
            if not ended_validating or (total is not None and batch_idx < total - 1):
                self._print_validation(loop, self._validated_step)
                self._validated_step = -1
        self._batches = batch_idx + 1
        now = time.perf_counter()
        compiled = self._warm_up_done(now)
        if now < self._next_refresh and not compiled:
            self._next_read(now)
            return
        if self._progress is not None:
            self._next_refresh = now + 1.0 / self.refresh_per_second
            self._progress.update(self._tasks["train"], completed=self._batches,
                                  **self._batch_info(loop, now))
        else:
            self._next_refresh = now + self.plain_every_s
            total = loop.batches_per_epoch
            state = loop.state
            parts = [f"epoch {state.epoch + 1}/{state.epochs}",
                     f"batch {batch_idx + 1}/{'?' if total is None else total}"]
            if compiled:
                parts.append(f"compiled in {now - self._warm_up_start:.1f}s")
            parts += [part for part in self._batch_info(loop, now).values() if part]
            self._print("  ".join(parts))
        self._next_read(now)

    def _next_read(self, now: float) -> None:
        """When to read the clock again: after half the batches that the pace so far
        (since the latest read) fits before the next refresh, at most a quarter second's
        worth, at least the next one. The
        reads come closer as the refresh nears (a pace that slows down is seen in time);
        a step of microseconds reads it a few times per refresh, not once per batch."""
        then, batches = self._last_read
        done = self._batches - batches
        pace = done / (now - then) if now > then and done > 0 and batches >= 0 else 0.0
        self._last_read = (now, self._batches)
        # Looked ahead at most a quarter second: steps that slow down by a factor f delay a
        # line by at most f/4 s, however long the refresh interval (plain_every_s=60).
        ahead = min(0.5 * (self._next_refresh - now), 0.25)
        self._countdown = max(1, int(ahead * pace))
        if self._validated_step >= 0:  # a validation's line waits for the next batch end
            self._countdown = 1

    def on_validation_start(self, loop: Loop) -> None:
        """Show the validation bar."""
        self._val_batches = 0
        if loop.phase is Phase.VALIDATE:  # not a pass inside it (EMA's second)
            self._train_batch_idx = loop.state.batch_idx
        if self._progress is not None and loop.phase is Phase.VALIDATE:
            self._next_refresh = 0.0
            self._progress.update(self._tasks["train"], completed=self._batches)
            self._task("val", "validation", length_of(loop.val_data))
            if self._compiling:
                self._progress.update(self._tasks["val"], loss=COMPILING)

    def on_validation_batch_end(self, loop: Loop) -> None:
        """Advance the validation bar, time-throttled."""
        self._val_batches += 1
        if self._progress is None or "val" not in self._tasks:
            return
        now = time.perf_counter()
        if now >= self._next_refresh:
            self._next_refresh = now + 1.0 / self.refresh_per_second
            self._progress.update(self._tasks["val"], completed=self._val_batches)

    def on_validation_end(self, loop: Loop) -> None:
        """Hide the validation bar; note the step of a validation inside fit."""
        if loop.phase is Phase.VALIDATE:
            self._validated_step, self._after_validation = loop.state.step, True
            self._countdown = 1  # the next batch end prints its line and counts from its batch
        if self._progress is not None and "val" in self._tasks:
            self._progress.update(self._tasks["val"], completed=self._val_batches, visible=False)

    def on_epoch_end(self, loop: Loop) -> None:
        """Print the epoch's metrics: a table row (terminal) or a plain line.

        The epoch's row of ``loop.state.history`` as it is when this runs (what the
        callbacks before it wrote in ``on_epoch_end`` included): ``val_*`` metrics only when
        a validation ran at this step or a callback wrote them at this epoch end, otherwise
        they are an earlier validation's values.
        """
        state = loop.state
        seconds = time.perf_counter() - self._epoch_start
        fresh = self._validated_step == state.step
        self._validated_step, self._after_validation = -1, False
        row = state.history[-1] if state.history else {}
        if loop.epoch_completed and (row.get("epoch"), row.get("step")) == (state.epoch,
                                                                            state.step):
            shown = {name: value for name, value in row.items()  # the bar shows its own lr
                     if name not in ("epoch", "step") and not is_learning_rate(name)}
        else:  # an epoch stop() cut short records no row
            shown = {name: value for name, value in state.metrics.items()
                     if fresh or not name.startswith(("val_", "ema_val_"))}
        metrics = {name: value for name, value in shown.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        lr = loop.optimizer.param_groups[0]["lr"] if loop.optimizer.param_groups else None
        if self._progress is None:
            parts = [f"epoch {state.epoch + 1}/{state.epochs}", f"step {state.step}"]
            parts += [f"{name} {format_number(value)}" for name, value in metrics.items()]
            if lr is not None:
                parts.append(f"lr {float(lr):.2e}")
            if "samples_per_s" not in metrics:  # else the monitor's figure is the one shown
                speed = self._speed(time.perf_counter() - self._speed_start)
                if speed:
                    parts.append(f"{speed} samples/s")
            parts.append(f"{seconds:.1f}s")
            self._print("  ".join(parts))
            return
        self._progress.update(self._tasks["train"], completed=self._batches)
        self._progress.update(self._tasks["epoch"], completed=state.epoch + 1)
        self._print_row(state.epoch + 1, state.epochs, state.step, metrics, seconds)

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        """Stop the bars now, so the traceback that follows is readable."""
        self._stop()

    def on_fit_end(self, loop: Loop) -> None:
        """Stop the bars; those the fit left unfinished say ``stopped`` instead of an ETA (a
        bar of data without a length: when the fit cut its epoch short)."""
        if self._progress is not None:
            for task in self._progress.tasks:
                unfinished = (not loop.epoch_completed if task.total is None
                              else task.completed < task.total)
                if task.visible and unfinished:
                    self._progress.update(task.id, stopped=True)
        self._stop()

    # ------------------------------------------------------------------ inside
    def _task(self, key: str, description: str, total: int | None) -> None:
        assert self._progress is not None
        if key in self._tasks:
            self._progress.reset(self._tasks[key], total=total, completed=0,
                                 description=description, visible=True, loss="", lr="",
                                 speed="")
        else:
            self._tasks[key] = self._progress.add_task(description, total=total)

    def _warm_up_done(self, now: float) -> bool:
        """At the fit's first training batch end under `Compile`: the compiling is over (True
        once); the speed clock restarts here, so the compile time is not in the speed."""
        if not self._compiling:
            return False
        self._compiling, self._compiled = False, True
        self._speed_start, self._samples = now, 0
        if self._progress is not None:
            self._progress.update(self._tasks["epoch"], loss="")
        return True

    def _speed(self, seconds: float) -> str:
        """The bar's own samples per second, of all ranks (DDP: every rank has as many; the
        ranks of a tensor-parallel group read the same ones)."""
        if not self._samples:
            return ""
        return format_number(self._samples * distributed.data_parallel_size()
                             / max(seconds, 1e-9))

    def _batch_info(self, loop: Loop, now: float) -> dict[str, Any]:
        """The batch bar's fields: ``loss``, ``lr`` and ``speed`` (each may be empty).

        The speed is `ThroughputMonitor`'s ``samples_per_s`` when it has reported this epoch
        (one figure on the screen), else the bar's own."""
        state = loop.state
        loss = "" if state.loss is None else (
            f"loss {format_number(float(state.loss.detach()))}")  # the one read
        groups = loop.optimizer.param_groups
        lr = f"lr {float(groups[0]['lr']):.2e}" if groups else ""
        reported = state.metrics.get("samples_per_s")
        if reported is not None:
            speed = format_number(float(reported))
        else:
            speed = self._speed(now - self._speed_start)
        return {"loss": loss, "lr": lr, "speed": f"{speed} samples/s" if speed else ""}

    def _print_validation(self, loop: Loop, step: int) -> None:
        state = loop.state
        parts = [f"epoch {state.epoch + 1}/{state.epochs}", f"step {step}", "validation"]
        parts += [f"{name} {format_number(float(value))}" for name, value in state.metrics.items()
                  if name.startswith(("val_", "ema_val_")) and isinstance(value, (int, float))
                  and not isinstance(value, bool)]
        self._print_parts(parts)

    def _print(self, line: str) -> None:
        assert self.console is not None
        # Plain lines stay one line each (a log); above the bars, rich wraps at the width.
        self.console.print(line, markup=False, highlight=False, soft_wrap=not self._bars)

    def _print_parts(self, parts: list[str]) -> None:
        """``name value`` parts joined by two spaces; above the bars, lines broken between
        parts at the console's width (continuation lines indented), never inside one."""
        assert self.console is not None
        if not self._bars:
            self._print("  ".join(parts))
            return
        width, lines = self.console.width, [parts[0]]
        for part in parts[1:]:
            if len(lines[-1]) + 2 + len(part) <= width:
                lines[-1] += "  " + part
            else:
                lines.append("  " + part)
        for line in lines:
            self._print(line)

    def _print_row(self, epoch: int, epochs: int, step: int, metrics: dict[str, Any],
                   seconds: float) -> None:
        from rich import box
        from rich.measure import Measurement
        from rich.table import Table

        names = list(metrics)
        header = names != self._columns
        self._columns = names
        table = Table(box=box.SIMPLE_HEAD, show_header=header, show_edge=False, pad_edge=False)
        width = len(str(epochs))
        table.add_column("epoch", justify="right", min_width=max(5, 2 * width + 1))
        table.add_column("step", justify="right", min_width=7)
        for name in names:
            table.add_column(name, justify="right", min_width=max(len(name), 10))
        table.add_column("time", justify="right", min_width=7)
        table.add_row(f"{epoch}/{epochs}", str(step),
                      *(format_number(float(metrics[name])) for name in names), f"{seconds:.1f}s")
        assert self._progress is not None
        console = self._progress.console
        unbounded = console.options.update(max_width=10_000)
        if Measurement.get(console, unbounded, table).maximum > console.width:
            # Too many metrics for a row: a squeezed table cuts the numbers, a line does not.
            self._columns = None
            self._print_parts([f"epoch {epoch}/{epochs}", f"step {step}",
                               *(f"{name} {format_number(float(metrics[name]))}"
                                 for name in names), f"{seconds:.1f}s"])
            return
        console.print(table)

    def _stop(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.stop()
