"""ProgressBar rendered into recording rich consoles, once as a terminal and once not."""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import Metrics, ProgressBar

from builders import accuracy, classification_batches, sgd
from builders import make_loop as build_loop


def make_loop(callbacks, *, sized: bool = True) -> Loop:
    data = classification_batches(6, seed=1)
    train = data if sized else (batch for batch in data)
    return build_loop(callbacks, model=lambda: torch.nn.Linear(5, 3), train=train,
                      val=data[:2], optimizer=sgd(0.05), loss_fn=F.cross_entropy)


def console(terminal: bool) -> Console:
    return Console(file=io.StringIO(), record=True, force_terminal=terminal, width=120,
                   color_system=None if not terminal else "standard")


def test_terminal_shows_bars_and_a_metrics_table() -> None:
    screen = console(True)
    loop = make_loop([Metrics(acc=accuracy), ProgressBar(console=screen)])
    state = loop.fit(3)
    text = screen.export_text()
    assert "epoch 3/3" in text and "validation" in text and "samples/s" in text
    assert "loss " in text and "lr 5.00e-02" in text
    header = [line for line in text.splitlines() if "train_loss" in line and "val_acc" in line]
    assert header, text
    metrics = state.metrics  # the last epoch's table row (printed above the live bars)
    row = rf"3/3\s+18\s+{metrics['train_loss']:#.4g}\s+{metrics['val_loss']:#.4g}\s+{metrics['val_acc']:#.4g}"
    assert re.search(row, text), text


def test_not_a_terminal_prints_one_plain_line_per_epoch() -> None:
    screen = console(False)
    loop = make_loop([Metrics(acc=accuracy), ProgressBar(console=screen)])
    history = loop.fit(3).history
    raw = screen.file.getvalue()
    assert "\r" not in raw and "\x1b" not in raw
    lines = raw.splitlines()
    assert len(lines) == 3
    for epoch, (line, row) in enumerate(zip(lines, history), start=1):
        assert line.startswith(f"epoch {epoch}/3  step {6 * epoch}  ")
        for name in ("train_loss", "val_loss", "val_acc"):
            assert f"{name} {row[name]:#.4g}" in line


def test_plain_lines_inside_long_epochs_keep_a_log_alive(monkeypatch) -> None:
    screen = console(False)
    clock = iter(range(0, 10_000, 7))  # every batch: 7 s later
    monkeypatch.setattr("hookloop.callbacks.progress.time.perf_counter", lambda: next(clock))
    make_loop([ProgressBar(console=screen, plain_every_s=20)]).fit(1)
    lines = screen.file.getvalue().splitlines()
    assert any(line.startswith("epoch 1/1  batch ") and "/6  loss " in line for line in lines)
    assert lines[-1].startswith("epoch 1/1  step 6")


def test_data_without_length_shows_a_counter() -> None:
    screen = console(True)
    make_loop([ProgressBar(console=screen)], sized=False).fit(1)
    assert "6/?" in screen.export_text()


def test_bars_stop_before_the_traceback() -> None:
    screen = console(True)
    bar = ProgressBar(console=screen)

    class Fail(Callback):
        def on_batch_end(self, loop):
            if loop.state.step == 2:
                assert bar._progress is not None and bar._progress.live.is_started
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        make_loop([bar, Fail()]).fit(1)
    assert bar._progress is None  # stopped in on_exception, before on_fit_end


def test_bad_arguments() -> None:
    with pytest.raises(ConfigurationError, match="refresh_per_second"):
        ProgressBar(refresh_per_second=0)


@pytest.mark.parametrize("sized", [True, False])
def test_step_validation_shown_once_and_never_stale_at_epoch_end(sized: bool) -> None:
    """Validation every 4 steps, 6 batches an epoch: validations at steps 4, 8, 12 and 16.
    The epoch ends at steps 6 and 18 did not validate, so their lines must not repeat the
    previous validation's val_loss; each validation is shown once, where it ran."""
    screen = console(False)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(6)]
    validations: list[tuple[int, float]] = []

    class Seen(Callback):
        def on_validation_end(self, loop: Loop) -> None:
            validations.append((loop.state.step, loop.state.metrics["val_loss"]))

    class Unsized:  # iterable again every epoch, without a length
        def __iter__(self):
            return iter(data)

    train = data if sized else Unsized()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), train, val_data=data[:2],
                loss_fn=F.cross_entropy, device="cpu", val_every_n_epochs=None,
                val_every_n_steps=4, sanity_val_batches=0,
                callbacks=[Seen(), ProgressBar(console=screen)])
    loop.fit(3)
    lines = screen.file.getvalue().splitlines()
    assert [step for step, _ in validations] == [4, 8, 12, 16]
    shown = [line for line in lines if "val_loss" in line]
    assert len(shown) == 4, lines
    for line, (step, value) in zip(shown, validations):
        assert f"step {step}  " in line and f"val_loss {value:#.4g}" in line, line
    epoch_lines = [line for line in lines if line.startswith("epoch") and "train_loss" in line]
    assert len(epoch_lines) == 3 and [row["step"] for row in loop.state.history
                                      if "val_loss" in row] == [4, 8, 12, 16]
    # step 12 is epoch 2's last step: its validation is in that epoch's line
    assert "val_loss" in epoch_lines[1] and "val_loss" not in epoch_lines[0] + epoch_lines[2]


@pytest.mark.filterwarnings("ignore:install \"ipywidgets\":UserWarning")  # rich, without ipywidgets
def test_notebook_console_gets_bars() -> None:
    """rich's Console.is_terminal is False in Jupyter by design; the docs promise bars
    "in a terminal or a notebook", so a Jupyter console gets bars, not plain lines."""
    screen = Console(file=io.StringIO(), force_jupyter=True, width=100)
    bar = ProgressBar(console=screen)
    loop = make_loop([bar])
    bar.on_fit_start(loop)  # decides bars or plain lines
    try:
        assert bar._bars and bar._progress is not None
    finally:
        bar._stop()


def test_quiet_batches_read_no_clock_and_the_lines_still_come_on_time(monkeypatch) -> None:
    """400 batches of 10 fake ms, a plain line every 1 s: the lines come at the batches a
    per-batch clock would print them (every 100 batches), and the clock is read a few times
    per line, not once per batch (a fast step pays only a counter)."""
    import types

    from hookloop.callbacks import progress as progress_module

    class Clock:
        now, reads = 0.0, 0

        def perf_counter(self) -> float:
            self.reads += 1
            return self.now

    clock = Clock()
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(
        perf_counter=clock.perf_counter))

    class Tick(Callback):
        def on_batch_end(self, loop: Loop) -> None:  # runs before the bar's (listed first)
            clock.now += 0.01

    screen = console(False)
    data = classification_batches(400, seed=1)
    build_loop([Tick(), ProgressBar(console=screen, plain_every_s=1.0)],
               model=lambda: torch.nn.Linear(5, 3), train=data, optimizer=sgd(0.05),
               loss_fn=F.cross_entropy).fit(1)
    lines = screen.file.getvalue().splitlines()
    batches = [int(re.search(r"batch (\d+)/400", line)[1]) for line in lines if "batch " in line]
    assert len(batches) == 3 and all(abs(batch - 100 * n) <= 3 for n, batch in
                                     zip((1, 2, 3), batches)), batches
    assert clock.reads < 60, clock.reads
