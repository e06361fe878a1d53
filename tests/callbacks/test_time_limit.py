"""TimeLimit: each launch ends before its budget, with a checkpoint and exit status 75, and
the relaunches together end with the weights of the uninterrupted run (torch.equal)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import Checkpoint, TimeLimit

from builders import BatchCounter, dropout_loop
from conftest import stand_in_scontrol, subprocess_env

BUDGET = 2.0  # seconds per launch; the whole run trains for about 3 s

SCRIPT = textwrap.dedent("""
    import sys, time, torch
    import torch._dynamo  # a torch optimizer's first creation imports it (seconds on 2 cores)
    from hookloop import Callback, Loop
    from hookloop.callbacks import Checkpoint, TimeLimit
    sys.path.insert(0, {tests!r})
    from builders import dropout_loop

    # The budget counts from here (start="created"): BUDGET is too short for the seconds
    # an interpreter and torch's import take on a loaded machine, which the default counts.
    limit = TimeLimit(float(sys.argv[2]), start="created")

    class Slow(Callback):
        def on_batch_end(self, loop):
            time.sleep(0.05)

    class Report(Callback):  # last: the launch's end, after the save and every on_fit_end
        def on_fit_end(self, loop):
            print(f"ended at step {{loop.state.step}} after {{limit.elapsed:.3f}} s", flush=True)

    loop = dropout_loop([Slow(), limit, Checkpoint(sys.argv[1], resume=True), Report()],
                        batches=8)
    loop.fit(6)
    torch.save({{key: value for key, value in loop.model.state_dict().items()}},
               sys.argv[1] + "/../final.pt")
""")


def _launch(script: Path, directory: Path, budget: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script), str(directory), str(budget)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_launches_end_before_their_budget_and_together_equal_the_uninterrupted_run(
        tmp_path: Path, root: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(root / "tests")))
    directory = tmp_path / "limited" / "ckpt"
    launches = []
    for _ in range(8):
        result = _launch(script, directory, BUDGET)
        launches.append(result)
        if result.returncode != 75:
            break
        elapsed = float(result.stdout.split(" after ")[-1].split(" s")[0])
        assert elapsed < BUDGET, result.stdout  # ended before the budget ran out...
        assert "TimeLimit:" in result.stdout and "Traceback" not in result.stderr
        step = int(result.stdout.split("ended at step ")[-1].split()[0])
        assert any(path.name.endswith(f"step={step:08d}.pt") for path in directory.iterdir())
    assert launches[-1].returncode == 0, launches[-1].stderr[-3000:]
    assert len(launches) >= 2, "the budget never ended a launch"
    resumed = torch.load(tmp_path / "limited" / "final.pt", weights_only=True)

    plain = dropout_loop(batches=8)  # the uninterrupted run, here: one thread, the same math
    plain.fit(6)
    expected = plain.model.state_dict()
    for key, value in expected.items():
        assert torch.equal(resumed[key], value), key


def test_the_reserve_is_the_longest_step_and_twice_the_last_save(tmp_path: Path) -> None:
    seen: dict[str, float] = {}

    class Look(Callback):
        def on_epoch_end(self, loop: Loop) -> None:
            seen["save"] = saver.last_save_seconds
            seen["reserve"] = measured.reserve()

    measured, saver = TimeLimit(3600), Checkpoint(tmp_path)
    dropout_loop([measured, saver, Look()]).fit(1)
    assert seen["save"] is not None and seen["save"] > 0  # Checkpoint measured its save
    assert seen["reserve"] == pytest.approx(measured._longest + 2 * seen["save"])
    fixed = TimeLimit(3600, margin=30.0)
    dropout_loop([fixed]).fit(1)
    assert fixed.reserve() == pytest.approx(fixed._longest + 30.0)


def test_a_budget_spent_before_the_fit_ends_the_launch_at_the_first_step(tmp_path: Path) -> None:
    from hookloop import Suspended

    loop = dropout_loop([TimeLimit(datetime.timedelta(microseconds=1), start="created"),
                         Checkpoint(tmp_path)])
    with pytest.raises(Suspended) as ended:
        loop.fit(2)
    assert ended.value.code == 75 and loop.state.step == 1
    assert any(path.name.endswith("step=00000001.pt") for path in tmp_path.iterdir())


def test_without_a_saver_the_limit_ends_the_run_saying_nothing_was_saved(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 33, item 12: without a Checkpoint the launch ended with exit 75 and "relaunch
    the same command to continue it", but a relaunch starts again at step 0 (a requeueing
    cluster would never progress). The fit returns at the limit: no Suspended (a
    SystemExit), and the message says that nothing was saved and what would continue it."""
    ends = []

    class End(Callback):
        def on_fit_end(self, loop: Loop) -> None:
            ends.append((loop.state.step, loop.stop_requested, loop.stop_resumable))

    loop = dropout_loop([TimeLimit(datetime.timedelta(microseconds=1), start="created"),
                         End()])
    state = loop.fit(2)  # raised Suspended (exit 75) before
    assert state.step == 1 and ends == [(1, True, False)]
    said = capsys.readouterr().out
    assert "relaunch the same command" not in said and "exits with status" not in said
    assert ("training ended at epoch 1/2, step 1: TimeLimit: the time limit was reached "
            "(0.0 s of 1e-06 s left) and nothing was saved (no Checkpoint in the stack), so "
            "a relaunch starts again at step 0; add a Checkpoint to continue the run across "
            "launches.") in said


@pytest.mark.parametrize("duration", [0, -5, "soon", "1:2:3:4", True])
def test_a_bad_duration_is_refused(duration: object) -> None:
    with pytest.raises(ConfigurationError, match="TimeLimit duration must be seconds > 0"):
        TimeLimit(duration)  # type: ignore[arg-type]


def test_a_negative_margin_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="TimeLimit margin must be"):
        TimeLimit(60, margin=-1)


@pytest.mark.parametrize(("duration", "written"), [
    ("00:75", "'01:15'"), ("1:75:00", "'2:15:00'"), ("1-25", "'2-01:00:00'"),
    ("2-00:00:60", "'2-00:01:00'")])
def test_a_slurm_time_with_a_field_out_of_range_is_refused_with_the_time_meant(
        duration: str, written: str) -> None:
    """Issue 25, item 11: "00:75" was read as 75 s; a field after the first counts up to
    59 (hours after a day up to 23), and the message writes the time it would have been."""
    with pytest.raises(ConfigurationError, match=rf"TimeLimit duration '{duration}' has .*"
                                                 rf"write {written}"):
        TimeLimit(duration)


def test_the_first_field_of_a_slurm_time_may_be_large() -> None:
    assert TimeLimit("90").duration == 90 * 60  # minutes, as SLURM reads it
    assert TimeLimit("75:00").duration == 75 * 60
    assert TimeLimit("1:59:59").duration == 7199


def test_two_time_limits_in_one_stack_are_refused_naming_both() -> None:
    from hookloop import CallbackOrderError

    counter = BatchCounter()
    loop = dropout_loop([TimeLimit(3600), counter, TimeLimit("2:00:00")])
    with pytest.raises(CallbackOrderError, match=r"TimeLimit\(3600.*position 0.*"
                                                 r"TimeLimit\(7200.*position 2.*only once"):
        loop.fit(1)
    assert counter.batches == 0  # refused before the first batch


START_SCRIPT = textwrap.dedent("""
    import time
    first_line = time.monotonic()  # before any import of the script
    import torch
    from hookloop.callbacks import TimeLimit
    time.sleep(0.5)  # a slow setup before the callback is created
    created = time.monotonic()
    limit = TimeLimit(3600)
    print(first_line, created, limit.started, flush=True)
""")


@pytest.mark.slow
def test_the_budget_counts_from_the_process_start(tmp_path: Path) -> None:
    """Not from the callback's creation: the interpreter's start, torch's import and a slow
    setup before it count (they are the scheduler's time too)."""
    script = tmp_path / "start.py"
    script.write_text(START_SCRIPT)
    before = time.monotonic()  # the same system-wide clock as the child's
    done = subprocess.run([sys.executable, str(script)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    first_line, created, started = map(float, done.stdout.split())
    tick = 2.0 / os.sysconf("SC_CLK_TCK")  # /proc's start time is in clock ticks
    assert before - tick <= started <= first_line < created


def test_a_created_start_counts_from_the_callbacks_creation() -> None:
    before = time.monotonic()
    limit = TimeLimit(60, start="created")
    assert before <= limit.started <= time.monotonic()
    assert "start='created'" in repr(limit)
    with pytest.raises(ConfigurationError, match="TimeLimit start"):
        TimeLimit(60, start="job")


def _left_of_the_budget(limit: TimeLimit) -> float:
    return limit.duration - limit.elapsed


def test_no_duration_under_slurm_reads_slurm_job_end_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 7200))
    end = float(os.environ["SLURM_JOB_END_TIME"])
    limit = TimeLimit()
    assert _left_of_the_budget(limit) == pytest.approx(end - time.time(), abs=2.0)


@pytest.mark.slow
def test_no_duration_under_slurm_asks_scontrol_without_the_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    end = datetime.datetime.now().replace(microsecond=0) + datetime.timedelta(hours=3)
    calls = tmp_path / "calls"
    stand_in_scontrol(tmp_path / "bin", calls,
                      output=f"JobId=4242 JobName=train\n   StartTime=2026-01-01T00:00:00 "
                             f"EndTime={end.isoformat()} Deadline=N/A")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no squeue there: scontrol answers
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    limit = TimeLimit()
    dropout_loop([limit]).fit(1)
    assert calls.read_text().split() == ["show", "job", "4242"]
    assert _left_of_the_budget(limit) == pytest.approx(end.timestamp() - time.time(), abs=2.0)


def stand_in_squeue(directory: Path, calls: Path, end: datetime.datetime) -> None:
    """A stand-in ``squeue`` in ``directory`` that appends its arguments to ``calls`` and
    prints ``end`` as ``squeue -o %e`` does."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "squeue"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nprintf '%s\\n' '{end.isoformat()}'\n")
    script.chmod(0o755)


@pytest.mark.slow
def test_no_duration_asks_squeue_once_at_the_first_fit_start_not_at_construction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33, item 11: construction ran squeue on every rank (one failing rank raised
    while the others waited); it is asked once, at fit start, and kept for later fits."""
    end = datetime.datetime.now().replace(microsecond=0) + datetime.timedelta(hours=2)
    calls = tmp_path / "calls"
    stand_in_squeue(tmp_path / "bin", calls, end)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    limit = TimeLimit()
    assert not calls.exists() and limit.duration is None
    assert "TimeLimit(None" in repr(limit)
    loop = dropout_loop([limit])
    loop.fit(1)
    assert calls.read_text().splitlines() == ["-h -j 4242 -o %e"]
    assert _left_of_the_budget(limit) == pytest.approx(end.timestamp() - time.time(), abs=2.0)
    loop.fit(2)  # a later fit keeps the answer
    assert len(calls.read_text().splitlines()) == 1


def test_a_slurm_job_past_its_end_ends_the_launch_at_the_first_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hookloop import Suspended

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) - 1))
    loop = dropout_loop([TimeLimit(), Checkpoint(tmp_path)])
    with pytest.raises(Suspended) as ended:
        loop.fit(2)
    assert ended.value.code == 75 and loop.state.step == 1


def test_no_duration_without_a_slurm_end_time_is_refused_with_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigurationError, match=r"not in a SLURM job.*TimeLimit\('3:50:00'\)"):
        TimeLimit()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # neither squeue nor scontrol
    counter = BatchCounter()
    loop = dropout_loop([TimeLimit(), counter])
    with pytest.raises(ConfigurationError, match="neither squeue nor scontrol"):
        loop.fit(1)
    assert counter.batches == 0  # refused before the first batch


def test_the_reserve_keeps_time_for_every_checkpoints_last_save(tmp_path: Path) -> None:
    """Two Checkpoints both write at the launch's end: the reserve is twice the sum of
    their last saves, each asked of its callback (no module-global mailbox)."""
    seen: dict[str, float] = {}

    class Look(Callback):
        def on_epoch_end(self, loop: Loop) -> None:
            seen["saves"] = first.last_save_seconds + second.last_save_seconds
            seen["reserve"] = measured.reserve()

    measured = TimeLimit(3600)
    first, second = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b", name="second")
    dropout_loop([measured, first, second, Look()]).fit(1)
    assert seen["reserve"] == pytest.approx(measured._longest + 2 * seen["saves"])
    again = TimeLimit(3600)
    dropout_loop([again]).fit(1)  # no Checkpoint in this stack: no save to keep time for
    assert again.reserve() == pytest.approx(again._longest)
