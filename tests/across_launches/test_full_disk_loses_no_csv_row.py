"""CSVLogger on a disk that fills up (issue 16, item 11): the launch that meets the full disk
stops with a LogWriteError, and the relaunch (space freed, ``resume=True``) writes every row
that was owed, in order, once each. The oracle is the file of an uninterrupted run, compared
byte for byte (the resumed run is bitwise the same on CPU, so its rows are too).

The full disk is simulated in the child (tests/scripts/full_log_disk.py --capacity: writes
get what fits, then ENOSPC), and, where this machine lets an unprivileged user namespace
mount one, it is a real 64 KiB tmpfs whose last free page the CSV outgrows.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

SCRIPT = ROOT / "tests" / "scripts" / "full_log_disk.py"
TIMEOUT = 240


def launch(out: Path, logs: Path, *args: str) -> dict:
    """One run of the script; its result.json (the step reached, the error if any)."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(SCRIPT), str(out), str(logs), *args],
                   env=subprocess_env(), timeout=TIMEOUT, capture_output=True, check=False)
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("uninterrupted")
    assert "error" not in launch(root / "out", root / "logs")
    return (root / "logs" / "log.csv").read_text()


def test_rows_a_full_disk_refused_are_written_by_the_relaunch(
        tmp_path: Path, uninterrupted: str) -> None:
    """The first launch stops at the full disk; a relaunch meets it again at its first write
    (before training); the third, with space, writes everything owed since the first."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    first = launch(out, logs, "--capacity", "1500")  # the file would need about 2000 bytes
    assert (logs / "log.csv").stat().st_size <= 1500  # the failed write left what fitted
    second = launch(out, logs, "--resume", "--capacity", "1500")
    third = launch(out, logs, "--resume")
    assert "error" not in third and third["step"] == 48
    assert (logs / "log.csv").read_text() == uninterrupted  # every row, in order, once
    assert 0 < first["step"] < 48 and second["step"] == first["step"]
    for launched in (first, second):
        assert launched["error"] == "LogWriteError"
        assert launched["message"].startswith(
            f"CSVLogger could not write {logs / 'log.csv'}: no space left on the device")


def mount_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not mount_works(), reason="no user namespace may mount a tmpfs here")
def test_on_a_real_full_tmpfs(tmp_path: Path, uninterrupted: str) -> None:
    """A 64 KiB tmpfs (mounted in a private mount namespace, gone with it) with one free page:
    the CSV outgrows it, the launch stops, the filler is deleted, the relaunch completes."""
    out, logs, copy = tmp_path / "out", tmp_path / "logs", tmp_path / "copy"
    for folder in (out, logs, copy):
        folder.mkdir()
    run = f"{sys.executable} {SCRIPT} {out} {logs}"
    shell = (f"mount -t tmpfs -o size=64k tmpfs {logs} || exit 77\n"
             f"head -c 61440 /dev/zero > {logs}/filler\n"
             f"{run} > {out}/first.log 2>&1\n"
             f"cp {out}/result.json {out}/first.json\n"
             f"rm {logs}/filler\n"
             f"{run} --resume > {out}/second.log 2>&1\n"
             f"cp {logs}/log.csv {copy}/log.csv\n")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", shell], env=subprocess_env(),
                          timeout=2 * TIMEOUT, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "error" not in json.loads((out / "result.json").read_text())
    assert (copy / "log.csv").read_text() == uninterrupted
    first = json.loads((out / "first.json").read_text())
    assert first["error"] == "LogWriteError" and "no space left" in first["message"]
