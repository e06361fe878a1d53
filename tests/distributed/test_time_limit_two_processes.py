"""TimeLimit under torchrun (2 ranks, gloo) in a SLURM job (issue 33, items 11 and 12):
rank 0 asks squeue once at fit start and every rank takes its answer; a failed answer ends
every rank with the same error within seconds (one rank used to raise alone at
construction while the other waited for torchrun's SIGKILL); a limit reached on one rank
without a Checkpoint ends the run on both at one step, with no exit status 75."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest

from launch import SCRIPTS, read, run_ok, torchrun

SCRIPT = SCRIPTS / "time_limit_ranks.py"


def _stand_ins(directory: Path, calls: Path, end: datetime.datetime, failing: bool) -> Path:
    """``squeue`` that appends ``RANK`` and its arguments to ``calls`` and prints ``end``
    (or, ``failing``, fails for rank 0); ``scontrol`` that fails (the last resort)."""
    directory.mkdir(parents=True)
    failure = 'if [ "$RANK" = "0" ]; then echo boom >&2; exit 1; fi\n' if failing else ""
    scripts = {"squeue": f'#!/bin/sh\necho "$RANK $@" >> {calls}\n{failure}'
                         f"printf '%s\\n' '{end.isoformat()}'\n",
               "scontrol": "#!/bin/sh\necho boom >&2\nexit 1\n"}
    for name, text in scripts.items():
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
    return directory


def _end() -> datetime.datetime:
    return datetime.datetime.now().replace(microsecond=0) + datetime.timedelta(hours=2)


@pytest.fixture(scope="module")
def asked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, datetime.datetime]:
    root = tmp_path_factory.mktemp("time_limit_ask")
    calls, end = root / "calls", _end()
    run_ok(SCRIPT, str(root / "out"), str(_stand_ins(root / "bin", calls, end, False)), "ask")
    return root / "out", calls, end


@pytest.mark.slow
def test_squeue_is_asked_once_by_rank_0_and_every_rank_takes_its_answer(
        asked: tuple[Path, Path, datetime.datetime]) -> None:
    out, calls, end = asked
    assert calls.read_text().splitlines() == ["0 -h -j 4242 -o %e"]  # was one per rank
    budgets = [read(out, "asked", rank)["duration"] for rank in (0, 1)]
    for rank in (0, 1):
        assert read(out, "constructed", rank) == {"duration": None}
    # Each rank counts the budget from its own process's start, to rank 0's end time.
    assert budgets[0] == pytest.approx(budgets[1], abs=30.0)
    assert budgets[0] > end.timestamp() - time.time()


@pytest.mark.slow
def test_a_limit_without_a_checkpoint_ends_the_run_on_every_rank_at_one_step(
        asked: tuple[Path, Path, datetime.datetime]) -> None:
    """Rank 1's budget is spent, rank 0's is not: the ranks agree on one boundary, the run
    ends there (not resumable) and the script goes on (run_ok: every rank exited 0)."""
    out = asked[0]
    ends = [read(out, "capped", rank) for rank in (0, 1)]
    # Rank 1 asks at step 1's boundary; the next step's gradient all-reduce carries it.
    assert ends[0] == ends[1] and ends[0]["step"] in (1, 2) and not ends[0]["resumable"]


@pytest.mark.slow
def test_a_failed_squeue_ends_every_rank_with_the_same_error_within_seconds(
        tmp_path: Path) -> None:
    bin_dir = _stand_ins(tmp_path / "bin", tmp_path / "calls", _end(), True)
    result = torchrun(SCRIPT, str(tmp_path / "out"), str(bin_dir), "fail", timeout=120)
    ended = time.time()
    assert result.returncode != 0
    errors = [read(tmp_path / "out", "error", rank) for rank in (0, 1)]
    assert errors[0]["type"] == errors[1]["type"] == "ConfigurationError"
    assert errors[0]["message"] == errors[1]["message"]
    assert "neither squeue nor scontrol told the end time of job 4242" in errors[0]["message"]
    started = max(read(tmp_path / "out", "started", rank)["time"] for rank in (0, 1))
    # The error came 4.5 s after the start on 2 busy cores; a rank left waiting used to
    # wait for torchrun's SIGKILL, 30 s after the other rank failed.
    assert ended - started < 20.0, (ended - started, result.stdout[-4000:])
    assert (tmp_path / "calls").read_text().splitlines() == ["0 -h -j 4242 -o %e"]
