"""Sharded checkpoints (2 ranks, FSDP, gloo) saved to ``s3://`` on moto's local server,
SIGKILLed (the whole torchrun group) 10 times, every other kill aimed at a save in
flight (objects listed without their manifest), the others at random moments: after
every kill each save the store lists is complete (every object of its manifest, of its
size and SHA-256) and keep-last holds; the relaunch ends on the uninterrupted run's
weights (scripts/remote_sharded.py)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import SCRIPTS, TIMEOUT, kill_job, read, run_ok, start

from hookloop.runfile.remote_store import RemoteStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from remote_kill_campaign import check_store  # noqa: E402
from s3_endpoint import s3_endpoint  # noqa: E402

KEEP, KILLS, SECONDS = 2, 10, 600.0  # the bound only stops a runaway: ~150 s on 2 cores


def kill_moment(store: RemoteStore, process: subprocess.Popen, aim: bool,
                delay: float) -> None:
    """Wait until this launch uploads; then, if ``aim``, until a save is in flight (objects
    of a checkpoint without its manifest), else ``delay`` seconds more."""
    begun, before = time.monotonic(), set(store.objects())
    while set(store.objects()) == before and process.poll() is None and \
            time.monotonic() - begun < TIMEOUT:
        time.sleep(0.05)
    if not aim:
        time.sleep(delay)
        return
    while not store.partial() and process.poll() is None and \
            time.monotonic() - begun < TIMEOUT:
        pass  # each listing is an HTTP round trip: no sleep, or the window is missed


@pytest.mark.slow
def test_sigkills_of_a_sharded_run_uploading_to_s3_resume_exactly(tmp_path: Path) -> None:
    with s3_endpoint() as options:
        endpoint = options["client_kwargs"]["endpoint_url"]
        url = "s3://runs/sharded"
        store = RemoteStore(url, options)
        script = SCRIPTS / "remote_sharded.py"
        run_ok(script, str(tmp_path), url, endpoint, "reference")
        chooser, kills, mid_upload = random.Random(1), 0, 0
        deadline = time.monotonic() + SECONDS
        while kills < KILLS and time.monotonic() < deadline:
            process = start(script, str(tmp_path), url, endpoint, "run")
            kill_moment(store, process, aim=kills % 2 == 0, delay=chooser.uniform(0.0, 1.0))
            if process.poll() is not None:
                break  # it finished: the relaunch below must still end exactly
            kill_job(process)
            process.communicate()
            kills += 1
            rotating, partial = check_store(store)
            assert rotating <= KEEP + 1, store.saves()
            mid_upload += partial > 0
        output = run_ok(script, str(tmp_path), url, endpoint, "resumed")
        rotating, partial = check_store(store)
        assert partial == 0 and rotating <= KEEP
        assert all(name.endswith(".dcp") for name in store.saves())
    print(f"{kills} kills of the sharded run, {mid_upload} left a partial upload")
    assert kills == KILLS, output[-3000:]
    assert mid_upload >= KILLS // 4, f"only {mid_upload} of {kills} kills fell mid-upload"
    reference, resumed = read(tmp_path, "reference-weights", 0), read(tmp_path,
                                                                        "resumed-weights", 0)
    for name, value in reference.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.slow
def test_an_upload_failing_on_rank_0_is_a_named_error_on_every_rank_at_one_step(
        tmp_path: Path) -> None:
    """2 ranks (FSDP, gloo) saving to s3:// every step; from step 3 rank 0's uploads are
    refused (Access Denied). Both ranks raise at the same step, rank 0 the upload's error
    naming the URL and the cause, rank 1 one naming rank 0 and the cause (before: rank 1
    trained on alone, with no error of its own, until torchrun killed it), and the launch
    exits non-zero (scripts/remote_upload_failure.py)."""
    from launch import torchrun

    with s3_endpoint() as options:
        endpoint = options["client_kwargs"]["endpoint_url"]
        url = "s3://runs/denied"
        result = torchrun(SCRIPTS / "remote_upload_failure.py", str(tmp_path), url, endpoint)
    assert result.returncode != 0, result.stdout[-4000:]
    errors = [read(tmp_path, "error", rank) for rank in (0, 1)]
    assert all(error is not None for error in errors), result.stdout[-4000:]
    assert errors[0]["class"] == "CheckpointError", errors
    assert f"to {url} failed: PermissionError: Access Denied" in errors[0]["message"]
    assert errors[1]["class"] == "CheckpointWriteError", errors
    assert f"the upload to {url} failed on rank 0" in errors[1]["message"]
    assert "Access Denied" in errors[1]["message"]
    assert errors[0]["step"] == errors[1]["step"] >= 3, errors
    assert errors[0]["step"] < 20 * 4, errors  # at a step, not at the run's end
