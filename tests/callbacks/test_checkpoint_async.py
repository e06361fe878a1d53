"""Checkpoint(async_save=True): the rotating files written in the background hold what a
synchronous save writes, one write at a time; a failed write is raised at the next step
boundary, naming the file, and the exception path writes that step again; fit end waits;
and 20 SIGKILLs during background writes leave no unreadable file and resume exactly."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from hookloop import Callback, CheckpointWriteError, Loop
from hookloop.runfile import checkpoint_files as checkpoint_module  # where Checkpoint's writes go
from hookloop.callbacks import Checkpoint
from hookloop.runfile.format import read_payload

from builders import dropout_loop
from kill_campaign import campaign
from test_fsdp import _entries as entries, _loop as fsdp_loop, one_process_group  # noqa: F401


def _files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("*.pt"))


def _same(first: object, second: object) -> bool:
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and torch.equal(first, second)
    if isinstance(first, dict):
        return isinstance(second, dict) and first.keys() == second.keys() and all(
            _same(first[key], second[key]) for key in first)
    if isinstance(first, (list, tuple)):
        return len(first) == len(second) and all(map(_same, first, second))
    return first == second


def test_background_files_hold_what_a_synchronous_save_writes(tmp_path: Path) -> None:
    for kind, background in (("sync", False), ("async", True)):
        loop = dropout_loop([Checkpoint(tmp_path / kind, every_n_steps=1, keep_last=3,
                                        async_save=background)])
        loop.fit(2)
        assert not any(thread.name == "hookloop-checkpoint-writer" and thread.is_alive()
                       for thread in threading.enumerate())  # fit end waited
    assert _files(tmp_path / "sync") == _files(tmp_path / "async") == [
        "epoch=0001-step=00000006.pt", "epoch=0001-step=00000007.pt",
        "epoch=0001-step=00000008.pt"]
    for name in _files(tmp_path / "sync"):
        sync = read_payload(tmp_path / "sync" / name, "cpu")
        written = read_payload(tmp_path / "async" / name, "cpu")
        assert _same(sync, written), name  # the "hookloop" entry too: epoch, step, kind


def test_one_write_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spans: list[tuple[float, float]] = []
    real = checkpoint_module.write_atomic

    def slow(payload: object, path: str) -> None:
        start = time.monotonic()
        time.sleep(0.05)  # longer than a step: the next save must wait for it
        real(payload, path)
        spans.append((start, time.monotonic()))

    monkeypatch.setattr(checkpoint_module, "write_atomic", slow)
    dropout_loop([Checkpoint(tmp_path, every_n_steps=1, async_save=True)]).fit(2)
    assert len(spans) >= 8  # every step (and each epoch end, its position being another)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))


def test_a_failed_write_is_raised_at_the_next_step_naming_the_file_and_saved_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = checkpoint_module.write_atomic, []

    def full_once(payload: object, path: str) -> None:
        calls.append(os.path.basename(path))
        if len(calls) == 3:  # what write_atomic raises on a full disk
            raise CheckpointWriteError(f"Cannot write the checkpoint {path}: writing failed: "
                                       "no space left on the device (the disk is full)")
        real(payload, path)

    class Slow(Callback):  # the failed write is over long before the next step ends
        def on_batch_end(self, loop: Loop) -> None:
            time.sleep(0.05)

    monkeypatch.setattr(checkpoint_module, "write_atomic", full_once)
    loop = dropout_loop([Slow(), Checkpoint(tmp_path, every_n_steps=1, keep_last=None,
                                            async_save=True)])
    with pytest.raises(CheckpointWriteError, match=r"epoch=0000-step=00000003\.pt.*disk is full"):
        loop.fit(2)
    assert loop.state.step == 4  # raised at the step boundary after the failed write
    # The exception path wrote the last completed step, synchronously; nothing else changed.
    assert calls == [f"epoch=0000-step={step:08d}.pt" for step in (1, 2, 3, 4)]
    assert _files(tmp_path) == [f"epoch=0000-step={step:08d}.pt" for step in (1, 2, 4)]


# ------------------------------------------------------------ SIGKILL during writes
def test_twenty_sigkills_during_background_writes(tmp_path: Path) -> None:
    """6 epochs (120 steps) leave room for 20 kills of a few steps each; every step has a
    background write in flight. The kills take about 40 s on quiet cores; the 300 s bound
    only stops a runaway (at 90 s a loaded CI machine ended one campaign at 19 kills)."""
    kills, killed_mid_write = campaign(tmp_path, epochs=6, async_save=True, kills=20,
                                       seconds=300, pause=0.2, join=180)
    assert kills == 20, f"only {kills} kills before the run finished or the time ran out"
    assert killed_mid_write >= 1, "no kill landed in the middle of a write"


# ------------------------------------------------------- directories of shards (FSDP)
def test_sharded_directories_written_in_the_background_resume_exactly(
        one_process_group: None, tmp_path: Path) -> None:
    """A one-process gloo group: the shards are staged on the host and written by the
    writer thread over a gloo group of its own; the directories are complete and the
    relaunch ends with the weights of the synchronous, uninterrupted run."""
    from hookloop.callbacks import FSDP

    whole = fsdp_loop([FSDP(state_dict="sharded"), Checkpoint(tmp_path / "whole")])
    whole.fit(3)
    directory = tmp_path / "ckpt"
    first = fsdp_loop([FSDP(state_dict="sharded"),
                       Checkpoint(directory, every_n_steps=2, keep_last=2, async_save=True)])
    first.fit(2)
    assert entries(directory) == ["epoch=0001-step=00000010.dcp", "epoch=0001-step=00000012.dcp"]
    resumed = fsdp_loop([FSDP(state_dict="sharded"),
                         Checkpoint(directory, every_n_steps=2, async_save=True, resume=True)])
    resumed.fit(3)
    for name, value in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name].full_tensor(), value.full_tensor())
