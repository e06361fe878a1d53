"""What the screen shows (issue 28, items 11-13), captured from rich consoles of 80 and 120
columns and compared line by line: one throughput figure with about four significant
digits, "compiling" during Compile's warm-up, lines that wrap between ``name value`` pairs,
and an ETA on the epochs bar once an epoch is done.

A fake clock (``perf_counter`` of the display and of ThroughputMonitor) advances 0.25 s per
training batch, so every speed and time printed is a hand computation.
"""

from __future__ import annotations

import io
import re
import sys
import time
import types
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from hookloop import Callback, Loop
from hookloop.callbacks import Compile, EarlyStopping, Metrics, ProgressBar, ThroughputMonitor
from hookloop.callbacks import progress as progress_module
from hookloop.callbacks import throughput as throughput_module

REDRAW = re.compile(r"\r\x1b\[2K(?:\x1b\[1A\x1b\[2K)*")
TIME = r"\d+:\d\d:\d\d"
BATCH = 0.25  # fake seconds per training batch


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    namespace = types.SimpleNamespace(perf_counter=fake.perf_counter)
    monkeypatch.setattr(progress_module, "time", namespace)
    monkeypatch.setattr(throughput_module, "time", namespace)
    return fake


class Tick(Callback):
    """Each training batch takes BATCH fake seconds; keeps the losses the bar may show."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.losses = clock, []

    def on_batch_end(self, loop: Loop) -> None:
        self.clock.now += BATCH
        self.losses.append(float(loop.state.loss.detach()))


class FakeCompile(Callback):
    """The display's view of Compile: the role, and a first training and a first
    validation forward that take long (90 fake seconds, and real time for a frame)."""

    roles = ("compiles",)

    def __init__(self, clock: Clock) -> None:
        self.clock, self.compiled = clock, set()

    @contextmanager
    def _first_call(self, loop: Loop) -> Iterator[None]:
        if loop.state.training not in self.compiled:
            self.compiled.add(loop.state.training)
            self.clock.now += 90.0
            time.sleep(0.4)  # the bars' refresh thread draws meanwhile
        yield

    def forward_context(self, loop: Loop) -> Any:
        return self._first_call(loop)


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


def four(value: float) -> str:
    """Four significant digits, trailing zeros kept (the values here are in 0.001..999)."""
    return f"{value:#.4g}"


def run(callbacks: list[Callback], width: int, *, terminal: bool = True,
        epochs: int = 2) -> tuple[Loop, Console]:
    screen = Console(file=io.StringIO(), force_terminal=terminal, width=width,
                     color_system=None)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(4)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), data, val_data=data[:2],
                loss_fn=F.cross_entropy, device="cpu",
                callbacks=[*callbacks, ProgressBar(console=screen, terminal=terminal,
                                                   refresh_per_second=20)])
    loop.fit(epochs)
    return loop, screen


def frames(screen: Console) -> list[list[str]]:
    """The bars' frames, each as its lines (those with an ``eta``)."""
    raw = screen.file.getvalue().replace("\x1b[?25l", "").replace("\x1b[?25h", "")
    drawn = [[line for line in chunk.splitlines() if " eta " in line]
             for chunk in REDRAW.split(raw)]
    return [lines for lines in drawn if lines]


def printed(screen: Console) -> list[str]:
    """The lines printed above the bars (or the plain lines), in order."""
    raw = screen.file.getvalue().replace("\x1b[?25l", "").replace("\x1b[?25h", "")
    return [line.rstrip() for chunk in REDRAW.split(raw) for line in chunk.splitlines()
            if line.strip() and " eta " not in line]


@pytest.mark.parametrize("width", [80, 120])
def test_one_throughput_figure_four_digits_and_rows_that_wrap_between_pairs(
        clock: Clock, width: int) -> None:
    tick = Tick(clock)
    loop, screen = run([tick, Metrics(acc=accuracy), ThroughputMonitor(every_n_steps=2)],
                       width)
    # By hand: the monitor's clock starts at the first batch; its report at step 2 spans one
    # tick (32 samples/s), at step 4 two ticks for the 8 samples of steps 3 and 4.
    rows = loop.state.history
    assert [row["samples_per_s"] for row in rows] == [8 / (2 * BATCH)] * 2 == [16.0, 16.0]
    assert [row["batches_per_s"] for row in rows] == [4.0, 4.0]
    lines = printed(screen)
    if width == 80:  # too wide for a table row: a line, broken between pairs
        expected = []
        for epoch, row in enumerate(rows, start=1):
            expected += [f"epoch {epoch}/2  step {4 * epoch}  samples_per_s 16.00  "
                         f"batches_per_s 4.000  train_loss {four(row['train_loss'])}",
                         f"  val_loss {four(row['val_loss'])}  val_acc {four(row['val_acc'])}"
                         f"  1.0s"]
        assert lines == expected
    else:  # a table: the header once, then a row per epoch, cell by cell
        names = ["epoch", "step", "samples_per_s", "batches_per_s", "train_loss", "val_loss",
                 "val_acc", "time"]
        assert [line.split() for line in lines if not set(line.strip()) <= {"─", " "}] == [
            names, *[[f"{epoch}/2", str(4 * epoch), "16.00", "4.000", four(row["train_loss"]),
                      four(row["val_loss"]), four(row["val_acc"]), "1.0s"]
                     for epoch, row in enumerate(rows, start=1)]]
    assert all(len(line) <= width for line in lines)
    final = frames(screen)[-1]
    patterns = [rf"epochs +━+ 2/2 {TIME} eta 0:00:00",
                rf"epoch 2/2 +━+ 4/4 {TIME} eta 0:00:00 loss {four(tick.losses[-1])}"]
    if width == 120:  # the speed column fits: the monitor's figure, the only one
        patterns[1] += r" lr 5\.00e-02 16\.00 samples/s"
    assert len(final) == 2 and all(re.fullmatch(pattern, line.rstrip())
                                   for pattern, line in zip(patterns, final)), final
    assert all(line.count("samples/s") <= 1 for lines in frames(screen) for line in lines)


@pytest.mark.parametrize("width", [80, 120])
def test_the_epochs_bar_has_an_eta_once_an_epoch_is_done(clock: Clock, width: int) -> None:
    _, screen = run([Tick(clock)], width, epochs=3)
    epochs_lines = [line for lines in frames(screen) for line in lines
                    if line.startswith("epochs")]
    done = [line for line in epochs_lines if re.search(r" [12]/3 ", line)]
    assert done and epochs_lines[-1].split()[-3:] != ["eta", "-:--:--"]
    for line in done:
        assert re.search(rf" [12]/3 {TIME} eta {TIME}\s*$", line), line
        assert len(line.rstrip()) <= width


@pytest.mark.parametrize("width", [80, 120])
def test_plain_lines_say_compiling_then_how_long_it_took(clock: Clock, width: int) -> None:
    tick = Tick(clock)
    loop, screen = run([FakeCompile(clock), tick], width, terminal=False)
    rows = loop.state.history
    # The sanity check's validation compiles (90 s), then the first training batch (90 s,
    # and its own 0.25 s); the speed counts the 3 batches after it: 12 samples in 0.75 s.
    assert screen.file.getvalue().splitlines() == [
        "compiling the model (torch.compile): the first training and validation batches take "
        "longer",
        f"epoch 1/2  batch 1/4  compiled in 180.2s  loss {four(tick.losses[0])}  lr 5.00e-02",
        f"epoch 1/2  step 4  train_loss {four(rows[0]['train_loss'])}  "
        f"val_loss {four(rows[0]['val_loss'])}  lr 5.00e-02  16.00 samples/s  91.0s",
        f"epoch 2/2  step 8  train_loss {four(rows[1]['train_loss'])}  "
        f"val_loss {four(rows[1]['val_loss'])}  lr 5.00e-02  16.00 samples/s  1.0s"]


@pytest.mark.parametrize("width", [80, 120])
def test_bars_say_compiling_during_the_warm_up_and_no_speed(clock: Clock, width: int) -> None:
    _, screen = run([FakeCompile(clock), Tick(clock)], width)
    drawn = frames(screen)
    compiling = [lines for lines in drawn if any("compiling the model…" in line
                                                 for line in lines)]
    assert compiling, drawn  # drawn while the fake compile sleeps
    first = drawn.index(compiling[0])
    for lines in drawn[first:first + len(compiling)]:
        assert all("samples/s" not in line and len(line.rstrip()) <= width for line in lines)
    assert "compiling" not in " ".join(drawn[-1])
    if width == 120:  # the speed after the warm-up: 12 samples in 0.75 s, then 16 in 1 s
        assert drawn[-1][-1].rstrip().endswith("16.00 samples/s"), drawn[-1]


def test_compile_has_the_role_the_display_reads() -> None:
    assert progress_module.COMPILES in Compile.roles


@pytest.mark.parametrize("value, shown", [
    (1221.1774, "1221"), (993.04, "993.0"), (0.5, "0.5000"), (1.0986, "1.099"),
    (12.345, "12.35"), (999.97, "1000"), (0.0012345, "0.001234"), (3e-06, "3.000e-06"),
    (123456.7, "123457"), (2.5e7, "2.500e+07"), (0.0, "0.000"), (-0.25, "-0.2500")])
def test_numbers_have_four_significant_digits(value: float, shown: str) -> None:
    assert progress_module.format_number(value) == shown


class Terminal(io.StringIO):
    """sys.stdout as a terminal of the width COLUMNS says."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("width", [80, 120])
def test_an_early_stopped_run_ends_with_no_eta_and_whole_words(
        clock: Clock, width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37 item 8: after an early stop the epochs bar kept "eta 0:00:02", and the
    loop's end line, longer than the terminal, was cut by it mid-word."""
    stdout = Terminal()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setenv("COLUMNS", str(width))
    screen = Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(4)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.0), data, val_data=data[:2],
                loss_fn=F.cross_entropy, device="cpu",
                callbacks=[Tick(clock), EarlyStopping("val_loss", patience=1),
                           ProgressBar(console=screen, refresh_per_second=20)])
    loop.fit(6)  # lr 0: val_loss never improves, the stop comes after epoch 2 of 6
    assert loop.state.epoch + 1 == 2 and loop.state.step == 8
    raw = screen.file.getvalue().replace("\x1b[?25l", "").replace("\x1b[?25h", "")
    last = [line.rstrip() for line in REDRAW.split(raw)[-1].splitlines() if line.strip()]
    assert len(last) == 2 and all(len(line) <= width for line in last), last
    assert re.fullmatch(rf"epochs +━+ +2/6 {TIME} stopped", last[0]), last
    assert re.fullmatch(rf"epoch 2/6 +━+ 4/4 {TIME} +eta 0:00:00 loss .*", last[1]), last
    best = min(row["val_loss"] for row in loop.state.history)
    said = (f"hookloop: training ended at epoch 2/6, step 8: EarlyStopping: val_loss did not "
            f"improve for 1 validations (best {best:.6g} at epoch 1).")
    lines = stdout.getvalue().splitlines()
    assert len(said) > width and len(lines) > 1  # it had to be broken
    assert all(len(line) <= width for line in lines), lines
    assert lines[0].startswith("hookloop: ") and all(line.startswith("  ") for line in lines[1:])
    assert " ".join(line.strip() for line in lines) == said  # broken between words only


def test_a_run_over_data_without_a_length_that_ends_normally_is_not_called_stopped(
        clock: Clock) -> None:
    """Found in review: a bar over data without a length has no total, and every such bar
    said ``stopped`` at the end of a fit that trained all its epochs."""

    class Batches:  # no __len__
        def __iter__(self) -> Iterator[Any]:
            generator = torch.Generator().manual_seed(0)
            for _ in range(4):
                yield torch.randn(4, 5, generator=generator), torch.randint(0, 3, (4,))

    screen = Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)
    model = torch.nn.Linear(5, 3)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), Batches(),
                loss_fn=F.cross_entropy, device="cpu",
                callbacks=[Tick(clock), ProgressBar(console=screen, refresh_per_second=20)])
    loop.fit(2)
    raw = screen.file.getvalue().replace("\x1b[?25l", "").replace("\x1b[?25h", "")
    last = [line.rstrip() for line in REDRAW.split(raw)[-1].splitlines() if line.strip()]
    assert last and not any("stopped" in line for line in last), last
    assert any(re.match(r"epoch 2/2 .* 4/\?", line) for line in last), last
