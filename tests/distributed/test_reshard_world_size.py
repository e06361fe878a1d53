"""A run stopped inside an epoch and resumed on another number of ranks (torchrun, gloo):
2 ranks resumed on 1 and on 3, 1 rank resumed on 2 (DDP), 2 ranks resumed on 1 (FSDP,
sharded checkpoints). Over the launches every sample of the
interrupted epoch is trained exactly once (the dataset records each index it reads), the
next epoch once more, the step count ends where the run's geometry says, the warmup-cosine
schedule built from ``loop.total_steps`` ends at the uninterrupted run's final learning
rate, the CSV log holds every step's row once, and nothing warns that the position is
approximate.

Four launches: 1 rank (the 1-rank run, stopped), 2 ranks (the 2-rank runs, stopped; then
the 1-rank run resumed), 1 rank and 3 ranks (each resuming a copy of the 2-rank runs'
checkpoints).
"""

from __future__ import annotations

import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from launch import SCRIPTS, read, run_ok

SCRIPT = SCRIPTS / "reshard.py"
MIN_LR = 0.001  # the script's


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("reshard")
    outputs = [run_ok(SCRIPT, str(out), "one:one:36:2:5:2:ddp", processes=1),
               run_ok(SCRIPT, str(out), "two:two:36:3:1:2:ddp", "one-on-2:one:36:2:0:2:ddp",
                      "fsdp:fsdp:36:3:1:2:fsdp")]
    for source, copy in (("two", "two-on-1"), ("two", "two-on-3"), ("fsdp", "fsdp-on-1")):
        shutil.copytree(out / source, out / copy)
    outputs.append(run_ok(SCRIPT, str(out), "two-on-1:two-on-1:36:3:0:2:ddp",
                          "fsdp-on-1:fsdp-on-1:36:3:0:2:fsdp", processes=1))
    outputs.append(run_ok(SCRIPT, str(out), "two-on-3:two-on-3:36:3:0:2:ddp", processes=3))
    return out, "\n".join(outputs)


def _reads(out: Path, name: str, ranks: int, epoch: int) -> Counter[int]:
    return Counter(index for rank in range(ranks)
                   for seen, index in read(out, name, rank)["reads"] if seen == epoch)


def _final_lr(total_steps: int) -> float:
    """The uninterrupted run's last learning rate: its schedule stepped to its end."""
    from hookloop.schedules import warmup_cosine

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    schedule = warmup_cosine(optimizer, total_steps, warmup_steps=2, min_lr=MIN_LR)
    for _ in range(total_steps):
        optimizer.step()
        schedule.step()
    return optimizer.param_groups[0]["lr"]


# (first run, its ranks, its batch size, resumed run, its ranks; samples of the epoch the
# first run's stop must leave, modulo the resumed run's global batch, for the resumed
# epoch to start inside one of its batches).
CASES = {"2 to 1": ("two", 2, 3, "two-on-1", 1, None),
         "2 to 3": ("two", 2, 3, "two-on-3", 3, 9),
         "1 to 2": ("one", 1, 2, "one-on-2", 2, 4),
         "FSDP 2 to 1": ("fsdp", 2, 3, "fsdp-on-1", 1, None)}


def _batches(samples: int, ranks: int, batch: int) -> int:
    """Batches each rank runs for ``samples`` sharded as DistributedSampler shards them."""
    return math.ceil(math.ceil(samples / ranks) / batch)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_sample_once_and_the_schedule_ends_where_the_uninterrupted_one_does(
        runs: tuple[Path, str], case: str) -> None:
    out, _ = runs
    first, first_ranks, batch, resumed, ranks, unaligned = CASES[case]
    everything = Counter(range(36))
    trained = _reads(out, first, first_ranks, 0)
    if unaligned is not None:  # the case this one is for: the position splits a batch
        assert sum(trained.values()) % unaligned != 0
    assert trained + _reads(out, resumed, ranks, 0) == everything
    assert _reads(out, resumed, ranks, 1) == everything
    # The steps taken, then those of the rest of the epoch and of the next one on the new
    # ranks; the uninterrupted run takes its 2 epochs on the first run's ranks.
    steps = read(out, first, 0)["step"] + _batches(36 - sum(trained.values()), ranks, batch) \
        + _batches(36, ranks, batch)
    for rank in range(ranks):
        final = read(out, resumed, rank)
        assert final["step"] == final["total_steps"] == steps
        assert final["lr"] == _final_lr(2 * _batches(36, first_ranks, batch))
    # The logger goes on in the file the first run began: every step's row once, in order.
    directory = first if resumed == "one-on-2" else resumed  # it resumed the first run's own
    rows = [line.split(",") for line in (out / directory / "log.csv").read_text().splitlines()]
    logged = [int(row[2]) for row in rows[1:] if row[0] == "step"]
    assert logged == list(range(1, steps + 1))


def test_nothing_says_the_position_is_approximate(runs: tuple[Path, str]) -> None:
    out, output = runs
    warned = [message for name, ranks in (("two-on-1", 1), ("two-on-3", 3), ("one-on-2", 2),
                                          ("fsdp-on-1", 1))
              for rank in range(ranks) for message in read(out, name, rank)["warnings"]]
    for text in [output, *warned]:
        assert "carry over exactly" not in text and "approximate" not in text
    assert "resumed with another global batch" in output  # the schedule says how it goes on
