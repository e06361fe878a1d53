"""ProgressBar at 80 columns (issue 19, item 8): every frame rich draws on a terminal console
of that width keeps its bars at least 20 characters and its times whole; columns are dropped
instead, and come back on a wider console."""

from __future__ import annotations

import io
import re
import time

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from hookloop import Callback, Loop
from hookloop.callbacks import Metrics, ProgressBar

# What rich's live display writes before each new frame: go to the line start, erase it, and
# move up and erase once per line of the previous frame.
REDRAW = re.compile(r"\r\x1b\[2K(?:\x1b\[1A\x1b\[2K)*")
TIME = re.compile(r"\d+:\d\d:\d\d|-:--:--")
READABLE_BAR = 20  # characters


class Slow(Callback):
    """A little time per batch, so the display refreshes inside each epoch."""

    def on_batch_end(self, loop: Loop) -> None:
        time.sleep(0.01)


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


def frames(width: int) -> list[list[str]]:
    """Every frame of the bars, as lines, drawn during a 3-epoch run at ``width`` columns."""
    screen = Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    data = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(30)]
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), data, val_data=data[:5],
         loss_fn=F.cross_entropy, device="cpu",
         callbacks=[Metrics(acc=accuracy), Slow(),
                    ProgressBar(console=screen, refresh_per_second=20)]).fit(3)
    raw = screen.file.getvalue().replace("\x1b[?25l", "").replace("\x1b[?25h", "")
    drawn = [chunk.splitlines() for chunk in REDRAW.split(raw)]
    bars = [[line for line in lines if re.match(r"(epochs|epoch \d+/\d+|validation) ", line)]
            for lines in drawn]
    return [lines for lines in bars if lines]


def test_at_80_columns_the_bars_stay_readable() -> None:
    drawn = frames(80)
    assert len(drawn) > 5  # the display refreshed inside the epochs
    for lines in drawn:
        for line in lines:
            assert len(line.rstrip()) <= 80, line
            assert "…" not in line, line  # no cut times or values
            fields = line.split()
            assert all(TIME.fullmatch(field) for field in fields if ":" in field), line
    final = drawn[-1]
    train = next(line for line in final if line.startswith("epoch 3/3"))
    assert train.count("━") >= READABLE_BAR, train  # the finished bar, at least 20 wide
    assert re.search(r" 30/30 ", train) and re.search(r"loss \d\.\d{3}\b", train), train
    assert re.search(r"eta \d+:\d\d:\d\d", train), train
    assert "samples/s" not in train  # a column dropped to make room


@pytest.mark.parametrize("width", [100, 140])
def test_wider_consoles_show_the_dropped_columns_again(width: int) -> None:
    final = frames(width)[-1]
    train = next(line for line in final if line.startswith("epoch 3/3"))
    assert len(train.rstrip()) <= width
    assert "samples/s" in train and re.search(r"lr 5\.00e-02", train), train
    assert train.count("━") >= READABLE_BAR
