"""A relaunch with a larger ``epochs`` stretches a factory's schedule, and says so: the old
and new total steps and the learning rate before and after (issue 19, item 10)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, subprocess_env
from hookloop import Callback, Loop
from hookloop.callbacks import LRScheduler
from hookloop.schedules import warmup_cosine

SCRIPT = ROOT / "tests" / "scripts" / "relaunch.py"


def launch(directory: Path, *args: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), str(directory), *args], cwd=ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def lr_after(total: int, steps: int) -> float:
    """The oracle: the learning rate of a fresh warmup_cosine(total) after ``steps`` steps."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = warmup_cosine(optimizer, total, warmup_steps=2)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


def test_a_relaunch_with_more_epochs_says_the_schedule_is_stretched(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    first = launch(directory, "--epochs", "6")  # 24 steps planned, stopped early at 12
    assert "LRScheduler:" not in first
    old_lr = float(first.split(" lr ")[1].split()[0])
    assert old_lr == pytest.approx(lr_after(24, 12), rel=1e-5)
    shutil.copytree(directory, tmp_path / "copy")
    second = launch(tmp_path / "copy", "--epochs", "12")  # 48 steps
    line = next(line for line in second.splitlines() if line.startswith("LRScheduler:"))
    assert line.startswith(
        "LRScheduler: the factory's schedule was built for 24 optimizer steps in all, and this "
        "fit's total is 48: it is rebuilt for 48 and continues where the run is (12 steps in), "
        f"so the learning rate goes from {lr_after(24, 12):.3g} to {lr_after(48, 12):.3g}.")
    assert "relaunch with the old epochs and max_steps" in line


class FailOnce(Callback):
    def __init__(self) -> None:
        self.armed = True

    def on_batch_start(self, loop: Loop) -> None:
        if self.armed and loop.state.step == 5:
            self.armed = False
            raise RuntimeError("a test failure")


def test_the_same_total_again_says_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """fit() again after an exception continues the same schedule: nothing is stretched."""
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
                device="cpu", callbacks=[
                    LRScheduler(functools.partial(warmup_cosine, warmup_steps=2)), FailOnce()])
    with pytest.raises(RuntimeError, match="a test failure"):
        loop.fit(2)
    assert loop.fit(2).step == 8
    assert "LRScheduler:" not in capsys.readouterr().out


def test_a_longer_fit_in_the_same_process_says_it_too(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
                device="cpu",
                callbacks=[LRScheduler(functools.partial(warmup_cosine, warmup_steps=2))])
    loop.fit(2)
    assert "LRScheduler:" not in capsys.readouterr().out
    loop.fit(4)
    assert ("LRScheduler: the factory's schedule was built for 8 optimizer steps in all, and "
            "this fit's total is 16: it is rebuilt for 16 and continues where the run is (8 "
            "steps in)") in capsys.readouterr().out
