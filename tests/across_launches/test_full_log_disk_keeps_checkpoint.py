"""A full disk under the views' folder (issue 16, item 12): training stops with a
LogWriteError naming the view, the file and the cause; the checkpoint taken on the way out
(Checkpoint.on_exception, which asks every view for its state) is still written, at the
step the run reached; and the relaunch with ``resume=True`` ends on the weights of an
uninterrupted run (``torch.equal``), with each TensorBoard step logged once.

The full disk is simulated in the child (tests/scripts/full_log_disk.py --capacity), and is
a real 64 KiB tmpfs where an unprivileged user namespace may mount one.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from builders import same_weights
from conftest import ROOT, subprocess_env

SCRIPT = ROOT / "tests" / "scripts" / "full_log_disk.py"
TIMEOUT = 240
STEPS = 48


def launch(out: Path, logs: Path, *args: str) -> dict:
    """One run of the script; its result.json (the step reached, the error if any)."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(SCRIPT), str(out), str(logs), *args],
                   env=subprocess_env(), timeout=TIMEOUT, capture_output=True, check=False)
    return json.loads((out / "result.json").read_text())


def newest_checkpoint_step(names: list[str]) -> int:
    return max(int(match.group(1)) for name in names
               if (match := re.fullmatch(r"epoch=\d+-step=(\d+)\.pt", name)))


def listing(directory: Path) -> list[str]:
    return [path.name for path in directory.iterdir()]


def logged_steps(log_dir: Path) -> list[int]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [event.step for event in events.Scalars("step/loss")]


def saved_weights_equal(a: Path, b: Path) -> bool:
    return same_weights(torch.load(a, weights_only=True), torch.load(b, weights_only=True))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    assert "error" not in launch(root / "out", root / "logs", "--views", "tensorboard")
    return root / "out" / "weights.pt"


def check_stopped_and_saved(first: dict, checkpoints: list[str], view: str, file: str) -> None:
    assert first["error"] == "LogWriteError"
    assert re.match(rf"{view} could not write {re.escape(file)}[^:]*: no space left on the device",
                    first["message"]), first["message"]
    assert not any("Checkpoint.on_exception also raised" in note for note in first["notes"])
    assert newest_checkpoint_step(checkpoints) == first["step"]  # saved on the way out


def test_tensorboard_on_a_full_disk(tmp_path: Path, uninterrupted: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    first = launch(out, logs, "--views", "tensorboard", "--capacity", "4000")
    check_stopped_and_saved(first, listing(out / "ckpt"), "TensorBoard",
                            str(logs / "tb" / "events.out.tfevents."))
    assert 0 < first["step"] < STEPS
    again = launch(out, logs, "--views", "tensorboard", "--resume")
    assert "error" not in again and again["step"] == STEPS
    assert saved_weights_equal(out / "weights.pt", uninterrupted)
    steps = logged_steps(logs / "tb")
    assert steps == sorted(set(steps))  # each step once
    # From the step the relaunch resumed at, nothing is missing; what the failed writer still
    # held before it is lost (the docs say so).
    assert set(range(first["step"], STEPS + 1)) <= set(steps)


def test_both_views_on_one_full_disk(tmp_path: Path) -> None:
    """Whichever view meets the full disk first is named, and the checkpoint is written."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    first = launch(out, logs, "--views", "csv,tensorboard", "--capacity", "3000")
    view = first["message"].split(" ")[0]
    file = str(logs / "log.csv") if view == "CSVLogger" else str(logs / "tb" / "events.out")
    check_stopped_and_saved(first, listing(out / "ckpt"), view, file)


def mount_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not mount_works(), reason="no user namespace may mount a tmpfs here")
def test_tensorboard_on_a_real_full_tmpfs(tmp_path: Path, uninterrupted: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    run = f"{sys.executable} {SCRIPT} {out} {logs} --views tensorboard"
    shell = (f"mount -t tmpfs -o size=64k tmpfs {logs} || exit 77\n"
             f"head -c 61440 /dev/zero > {logs}/filler\n"
             f"{run} > {out}/first.log 2>&1\n"
             f"cp {out}/result.json {out}/first.json\n"
             f"ls {out}/ckpt > {out}/first-checkpoints.txt\n"
             f"rm {logs}/filler\n"
             f"{run} --resume > {out}/second.log 2>&1\n")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", shell], env=subprocess_env(),
                          timeout=2 * TIMEOUT, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr
    first = json.loads((out / "first.json").read_text())
    check_stopped_and_saved(first, (out / "first-checkpoints.txt").read_text().split(),
                            "TensorBoard", str(logs / "tb" / "events.out.tfevents."))
    assert "error" not in json.loads((out / "result.json").read_text())
    assert saved_weights_equal(out / "weights.pt", uninterrupted)
