"""TimeLimit: each launch ends before its budget, with a checkpoint and exit status 75, and
the relaunches together end with the weights of the uninterrupted run (torch.equal)."""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import Checkpoint, TimeLimit
from hookloop.suspension import current

from builders import BatchCounter, dropout_loop
from conftest import subprocess_env

BUDGET = 2.0  # seconds per launch; the whole run trains for about 3 s

SCRIPT = textwrap.dedent("""
    import sys, time, torch
    import torch._dynamo  # a torch optimizer's first creation imports it (seconds on 2 cores)
    from hookloop import Callback, Loop
    from hookloop.callbacks import Checkpoint, TimeLimit
    sys.path.insert(0, {tests!r})
    from builders import dropout_loop

    limit = TimeLimit(float(sys.argv[2]))  # the budget counts from here

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
            seen["save"] = current().last_save
            seen["reserve"] = measured.reserve()

    measured = TimeLimit(3600)
    dropout_loop([measured, Checkpoint(tmp_path), Look()]).fit(1)
    assert seen["save"] is not None and seen["save"] > 0  # Checkpoint measured its save
    assert seen["reserve"] == pytest.approx(measured._longest + 2 * seen["save"])
    fixed = TimeLimit(3600, margin=30.0)
    dropout_loop([fixed]).fit(1)
    assert fixed.reserve() == pytest.approx(fixed._longest + 30.0)


def test_a_budget_spent_before_the_fit_ends_the_launch_at_the_first_step() -> None:
    from hookloop import Suspended

    loop = dropout_loop([TimeLimit(datetime.timedelta(microseconds=1))])
    with pytest.raises(Suspended) as ended:
        loop.fit(2)
    assert ended.value.code == 75 and loop.state.step == 1


@pytest.mark.parametrize("duration", [0, -5, "soon", "1:2:3:4", None, True])
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
