"""Profiler: a row per callback and event that ran, counted against an event recorder."""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from rich.console import Console

from hookloop import Callback, Loop
from hookloop.callbacks import GradClip, Profiler


class Slow(Callback):
    """Sleeps in after_step, so its row must dominate; records the events it ran."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def after_step(self, loop: Loop) -> None:
        import time

        time.sleep(0.002)
        self.calls["after_step"] = self.calls.get("after_step", 0) + 1

    def on_validation_end(self, loop: Loop) -> None:
        self.calls["on_validation_end"] = self.calls.get("on_validation_end", 0) + 1

    def on_exception(self, loop: Loop, exc: BaseException) -> None:  # never runs here
        raise AssertionError


def test_a_row_per_callback_and_event_that_ran_and_the_loop_phases() -> None:
    model = torch.nn.Linear(5, 3)
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(5)]
    slow, screen = Slow(), Console(file=io.StringIO(), width=120)
    profiler = Profiler(console=screen)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:2],
                loss_fn=F.cross_entropy, callbacks=[GradClip(1.0), slow, profiler], device="cpu")
    loop.fit(2)
    rows = profiler.report()
    calls = {(row["name"], row["event"]): row["calls"] for row in rows}
    assert calls[("Slow", "after_step")] == slow.calls["after_step"] == 10
    assert calls[("Slow", "on_validation_end")] == 2
    assert calls[("GradClip", "before_step")] == 10
    assert ("Slow", "on_exception") not in calls  # did not run: no row
    for phase in ("data", "forward", "backward", "step", "validation", "other"):
        assert ("(loop)", phase) in calls
    assert calls[("(loop)", "forward")] == 10 and calls[("(loop)", "validation")] == 2
    assert rows[0]["name"] == "Slow" and rows[0]["event"] == "after_step"  # 20 ms of sleep
    assert rows[0]["seconds"] >= 0.02
    assert abs(sum(row["share"] for row in rows) - 1.0) < 1e-9
    text = screen.file.getvalue()
    assert "Slow" in text and "after_step" in text and "share" in text
    assert loop.handler_wrapper is None  # reset at fit end


def test_errors_still_name_the_callback_through_the_wrapper() -> None:
    class Broken(Callback):
        def after_step(self, loop: Loop) -> None:
            raise ValueError("bad")

    model = torch.nn.Linear(5, 3)
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,)))]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
                callbacks=[Broken(), Profiler(print_table=False)], device="cpu")
    try:
        loop.fit(1)
    except ValueError as error:
        assert any("Broken at event after_step" in note for note in error.__notes__)
    else:
        raise AssertionError("no error")


def test_prints_on_rank_zero_only_and_measures_on_every_rank(monkeypatch) -> None:
    """Under torchrun every rank runs the stack: one table (rank 0's), not one per process."""
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(4)]
    for rank, prints in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)  # what torchrun sets for each process
        console = Console(file=io.StringIO(), width=100)
        profiler = Profiler(console=console)
        model = torch.nn.Linear(5, 3)
        Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
             device="cpu", callbacks=[GradClip(1.0), profiler]).fit(1)
        assert ("hookloop profile" in console.file.getvalue()) is prints, rank
        calls = {row["event"]: row["calls"] for row in profiler.report() if row["name"] == "GradClip"}
        assert calls == {"before_step": 4, "on_fit_start": 1}, calls
