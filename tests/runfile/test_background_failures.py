"""Background saves fail loudly (issue 36 item 5): 100 write failures injected at varied
points of a background save (creating the temporary file, in the middle of the write,
fsync, the rename, the upload of a URL's save) and at varied saves (the last one too) are
100 named errors raised at the step boundary after the failure (or before ``fit``
returns, for the last save), with 0 hangs; a process whose background save failed exits
with a non-zero status, never 0 without its file. On 2 ranks:
tests/distributed/test_background_failure_processes.py."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from hookloop import Callback, CheckpointError, CheckpointWriteError, Loop
from hookloop.callbacks import Checkpoint
from hookloop.runfile import checkpoint_files, storage
from hookloop.runfile.remote_store import RemoteStore

from builders import dropout_loop
from conftest import subprocess_env

POINTS = ("open", "mid-write", "fsync", "rename", "upload")
#: What each point's error says (the cause in words, as the message gives it).
CAUSES = {"open": "disk is full", "mid-write": "disk is full", "fsync": "input/output error",
          "rename": "permission denied", "upload": "PermissionError"}


class Hang(Exception):
    """A fit that did not end within its alarm."""


class WriteOver(Callback):
    """Before `Checkpoint` at each step boundary: the step took longer than the write (it
    waits for the writer thread), so the failure must show at exactly this boundary."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_batch_end(self, loop: Loop) -> None:
        for thread in threading.enumerate():
            if thread.name == "hookloop-checkpoint-writer":
                thread.join(timeout=20)
        self.steps.append(loop.state.step)


class _FailingFile:
    """A file whose writes fail with ENOSPC after ``good`` bytes."""

    def __init__(self, handle: Any, good: int) -> None:
        self._handle, self._good = handle, good

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self._good < size:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._good -= size
        return self._handle.write(data)

    def __enter__(self) -> "_FailingFile":
        return self

    def __exit__(self, *args: Any) -> None:
        self._handle.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _inject(monkeypatch: pytest.MonkeyPatch, point: str, failing_save: int) -> list[str]:
    """Make save number ``failing_save`` (1-based) fail at ``point``; the returned list gets
    the path that save writes."""
    count, active, failed = [0], [False], []
    real_write = checkpoint_files.write_atomic

    def counting_write(payload: Any, path: str) -> None:
        count[0] += 1
        active[0] = count[0] == failing_save
        if active[0]:
            failed.append(path)
        try:
            real_write(payload, path)
        finally:
            active[0] = False

    def armed(real: Any, error: OSError) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if active[0]:
                raise error
            return real(*args, **kwargs)
        return call

    if point != "upload":
        monkeypatch.setattr(checkpoint_files, "write_atomic", counting_write)
    if point == "open":
        monkeypatch.setattr(storage.tempfile, "mkstemp", armed(
            storage.tempfile.mkstemp, OSError(errno.ENOSPC, "No space left on device")))
    elif point == "mid-write":
        real_fdopen = storage.os.fdopen
        monkeypatch.setattr(storage.os, "fdopen", lambda fd, *a, **k: (
            _FailingFile(real_fdopen(fd, *a, **k), good=200 + 97 * failing_save)
            if active[0] else real_fdopen(fd, *a, **k)))
    elif point == "fsync":
        monkeypatch.setattr(storage.os, "fsync", armed(
            storage.os.fsync, OSError(errno.EIO, "Input/output error")))
    elif point == "rename":
        monkeypatch.setattr(storage.os, "replace", armed(
            storage.os.replace, OSError(errno.EACCES, "Permission denied")))
    else:
        real_put, uploads = RemoteStore._put, [0]

        def put(self: Any, local: str, key: str) -> Any:
            uploads[0] += 1
            if uploads[0] >= 1 + failing_save % 3:  # a run uploads a few times
                raise PermissionError("Access Denied")
            return real_put(self, local, key)
        monkeypatch.setattr(RemoteStore, "_put", put)
    return failed


def _one_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str,
                 failing_save: int, index: int
                 ) -> tuple[str, BaseException | None, list[int], list[str]]:
    """Run one fit with one injected failure: ``("error" | "hang" | "none", the error, the
    steps that began, the path of the failed save)``."""
    directory = tmp_path / f"run{index}"
    target = (f"memory://runs/failures-{os.getpid()}-{index}" if point == "upload"
              else str(directory))
    options: dict[str, Any] = {"staging_dir": str(directory)} if point == "upload" else {}
    probe = WriteOver()
    loop = dropout_loop([probe, Checkpoint(target, every_n_steps=1, keep_last=2,
                                           async_save=True, **options)])
    with monkeypatch.context() as patch:
        failed = _inject(patch, point, failing_save)
        signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(Hang()))
        signal.alarm(30)
        try:
            with warnings.catch_warnings():  # the exception path warns of the upload
                warnings.simplefilter("ignore")
                loop.fit(1)  # 4 steps, a save at each and at the epoch's end
        except Hang:
            return "hang", None, probe.steps, failed
        except Exception as error:  # noqa: BLE001 - counted below
            return "error", error, probe.steps, failed
        finally:
            signal.alarm(0)
    return "none", None, probe.steps, failed


def test_a_hundred_injected_background_write_failures_are_a_hundred_named_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    named, hangs, silent, late = 0, 0, [], []
    for index in range(100):
        point = POINTS[index % len(POINTS)]
        failing_save = 1 + (index // len(POINTS)) % 5  # saves 1 to 5: the last one too
        outcome, error, steps, failed = _one_failure(tmp_path, monkeypatch, point,
                                                     failing_save, index)
        if outcome == "hang":
            hangs += 1
            continue
        if outcome == "none":
            silent.append((point, failing_save))
            continue
        assert error is not None
        kind = CheckpointError if point == "upload" else CheckpointWriteError
        name = (f"memory://runs/failures-{os.getpid()}-{index}" if point == "upload" else
                os.path.basename(failed[0]) if failed else "(no save failed)")
        if isinstance(error, kind) and name in str(error) and CAUSES[point] in str(error):
            named += 1
        else:
            silent.append((point, failing_save, f"{type(error).__name__}: {error}"))
        # Raised at the boundary right after the failed save's step (an epoch end's save:
        # at that epoch end, before the next step), so no later step ran.
        if point != "upload" and failed:
            step = int(os.path.basename(failed[0]).split("step=")[1][:8])
            if steps[-1] > step + 1:
                late.append((point, failing_save, step, steps[-1]))
    assert (named, hangs) == (100, 0), silent[:5]
    assert late == []


SCRIPT = textwrap.dedent("""
    import errno, os, stat, sys, threading
    sys.path[:0] = [{tests!r}]
    from builders import dropout_loop
    from hookloop.callbacks import Checkpoint
    from hookloop.runfile import storage

    from_step, real = int(sys.argv[2]), storage.os.fsync

    def fsync(fd):  # a file's fsync in the writer thread, from that step on
        if threading.current_thread().name == "hookloop-checkpoint-writer" and \\
                stat.S_ISREG(os.fstat(fd).st_mode) and loop.state.step >= from_step:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    storage.os.fsync = fsync
    loop = dropout_loop([Checkpoint(sys.argv[1], every_n_steps=1, async_save=True)])
    loop.fit(2)
    print("fit returned")
""")


@pytest.mark.slow
def test_a_failed_background_save_exits_non_zero(tmp_path: Path) -> None:
    """The process's exit status (an uncaught named error) when the background saves fail
    from the first step on, from a middle one, and only at the last step (the last
    saves): never 0, and fit never returns."""
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parents[1])))
    for failing in (1, 4, 8):
        directory = tmp_path / f"ckpt{failing}"
        result = subprocess.run([sys.executable, str(script), str(directory), str(failing)],
                                env=subprocess_env(), capture_output=True, text=True,
                                timeout=120)
        assert result.returncode != 0 and "fit returned" not in result.stdout, result.stdout
        assert "CheckpointWriteError" in result.stderr, result.stderr[-2000:]
        assert "input/output error" in result.stderr

