"""Ending a launch under torchrun (2 ranks, gloo): SIGTERM and SIGUSR1 sent to one rank at
random moments stop both ranks at the same step, one checkpoint holds that step, every
rank exits with the signal's status, and the relaunch ends with the weights of the
uninterrupted run (torch.equal).

Three torchrun launches cover the ten moments: the script runs one scenario after another
in its processes and relaunches each interrupted run in-process (the checkpoint restores
every random stream, as a new process would); the last scenario of each signal is left to
end the processes, so that their real exit status is checked, and is relaunched by the
next launch.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from launch import SCRIPTS, TIMEOUT, kill_job, read, start

SCRIPT = SCRIPTS / "suspended.py"
MOMENTS = 5
SIGNALS = {"SIGTERM": (signal.SIGTERM, 143), "SIGUSR1": (signal.SIGUSR1, 138)}


def _launch(out: Path, names: list[str], chooser: random.Random) -> str:
    """Run the script over ``names``, sending each interrupted scenario's signal to a
    random rank at a random moment of its training; returns torchrun's output."""
    process = start(SCRIPT, str(out), *names)
    deadline = time.monotonic() + TIMEOUT
    try:
        for name in names:
            base = name.rstrip("!")
            if base not in {f"{kind}-{k}" for kind in SIGNALS for k in range(MOMENTS)} or \
                    (out / f"{base}.ready.rank0.json").exists():
                continue  # the reference, or a relaunch (it trains from a checkpoint)
            # Each scenario gets its own TIMEOUT: a launch runs six, one after the other, and
            # beside the suite's heaviest files the six together once took more than 150 s.
            deadline = time.monotonic() + TIMEOUT
            ready = [out / f"{base}.ready.rank{rank}.json" for rank in (0, 1)]
            while not all(path.exists() for path in ready):
                assert process.poll() is None, process.communicate()[0][-6000:]
                assert time.monotonic() < deadline, f"{base} never started"
                time.sleep(0.02)
            time.sleep(chooser.uniform(0.0, 0.6))  # a random moment of the ~1 s of training
            rank = chooser.randrange(2)
            number, _ = SIGNALS[base.split("-")[0]]
            os.kill(json.loads((out / f"pid.rank{rank}.json").read_text())["pid"], number)
        output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        kill_job(process)
        raise
    return output


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], int]:
    out = tmp_path_factory.mktemp("suspended")
    seed = random.randrange(10**6)
    chooser = random.Random(seed)
    term = [f"SIGTERM-{k}" for k in range(MOMENTS)]
    usr1 = [f"SIGUSR1-{k}" for k in range(MOMENTS)]
    outputs = {
        "SIGTERM": _launch(out, ["reference", *term[:-1], term[-1] + "!"], chooser),
        "SIGUSR1": _launch(out, [term[-1], *usr1[:-1], usr1[-1] + "!"], chooser),
        "last": _launch(out, [usr1[-1]], chooser),
    }
    return out, outputs, seed


@pytest.mark.parametrize("kind", sorted(SIGNALS))
def test_both_ranks_stop_at_one_step_with_one_checkpoint_and_the_signal_s_status(
        runs: tuple[Path, dict[str, str], int], kind: str) -> None:
    out, outputs, seed = runs
    _, status = SIGNALS[kind]
    for moment in range(MOMENTS):
        name = f"{kind}-{moment}"
        stopped = [read(out, f"{name}.stopped", rank) for rank in (0, 1)]
        context = f"{name} (seed {seed}): {stopped}\n{outputs[kind][-3000:]}"
        assert stopped[0]["step"] == stopped[1]["step"], context
        assert 0 < stopped[0]["step"] < 24, context  # 3 epochs of 8 steps: interrupted
        assert [entry["status"] for entry in stopped] == [status, status], context
        files = [file for file in stopped[0]["files"] if file.endswith(".pt")]
        step = stopped[0]["step"]
        assert len(files) == 1 and files[0].endswith(f"-step={step:08d}.pt"), context
    # The last moment ended the processes themselves: torchrun reports each one's status.
    reported = re.findall(r"^\s*exitcode\s+:\s*(-?\d+)", outputs[kind], re.MULTILINE)
    assert reported == [str(status)] * 2, outputs[kind][-4000:]


@pytest.mark.parametrize("kind", sorted(SIGNALS))
def test_the_relaunch_equals_the_uninterrupted_run(runs: tuple[Path, dict[str, str], int],
                                                   kind: str) -> None:
    out, outputs, seed = runs
    for rank in (0, 1):
        expected = read(out, "reference.final", rank)
        for moment in range(MOMENTS):
            resumed = read(out, f"{kind}-{moment}.final", rank)
            for key, value in expected.items():
                assert torch.equal(resumed[key], value), (kind, moment, rank, key, seed)
    assert "rank 0 done" in outputs["last"] and "rank 1 done" in outputs["last"]
