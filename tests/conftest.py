"""Fixtures every test gets, and what child processes need. The builders are in builders.py."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import stat
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# A suite started with SIGINT ignored (a background or nohup CI step) would have Python skip
# its Ctrl-C handler, here and in every process a test starts (an ignored signal is
# inherited across exec): the tests that send a real SIGINT would then test nothing.
# Python's own handler is put back, as an interactive shell gives it; a handler, unlike
# SIG_IGN, is reset to the default across exec, so the children get theirs too.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)


# platform caches what it asks the system once per process; MLflow asks for the processor
# (``uname -p``) when its first run starts. Asked here, so a library's probe is not counted
# as a process a test starts (`_processes_are_slow`), whichever test comes first.
platform.processor()

# Every test in these folders starts processes (torchrun, a relaunched script) by design.
_SLOW_FOLDERS = ("across_launches", "distributed")


# The whole suite runs on two workers, a test file to one worker (the README's
# ``-n 2 --dist loadfile``). xdist hands out the files with the most tests first, so the
# files that start processes for minutes, a few tests each, went last, and one worker ran
# them while the other had nothing left. The files go out longest first instead: these
# (seconds for the file on one worker, from the CI log's durations and single-file runs),
# then every other file with a slow test, then the in-process files, which fill the gaps
# at the end. Only the order of the files changes; a file's tests keep theirs.
_LONG_FILES = {
    "parallel/test_fault_tolerance_processes.py": 165,
    "parallel/test_fault_tolerance_hsdp_processes.py": 150,
    "distributed/test_remote_sharded_processes.py": 120,
    "runfile/test_remote_kill.py": 87,
    "docs_and_examples/test_benchmarks_instructions.py": 84,
    "docs_and_examples/test_benchmarks.py": 60,
    "test_typing.py": 57,
    "parallel/test_signals.py": 56,
    "distributed/test_fsdp_two_processes.py": 50,
    "across_launches/test_kill_and_resume_logs_each_row_once.py": 45,
    "distributed/test_mesh_processes.py": 35,
    "across_launches/test_kill_and_relaunch_uploads_each_best_once.py": 34,
    "distributed/test_suspension_two_processes.py": 25,
}


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") == "loadfile":  # the order the workers collect
        config.option.loadscopereorder = False


def _schedule(items: list[pytest.Item]) -> None:
    """Sort ``items`` file by file: the long files, the longest first, then the files
    with a slow test, then the rest, each kind in the order of collection."""
    here = Path(__file__).resolve().parent
    keys: dict[Path, tuple[int, int, int]] = {}
    for item in items:
        name = item.path.relative_to(here).as_posix() if item.path.is_relative_to(here) else ""
        quick = int(item.get_closest_marker("slow") is None)
        before = keys.get(item.path, (0, 1, len(keys)))
        keys[item.path] = (-_LONG_FILES.get(name, 0), min(before[1], quick), before[2])
    items.sort(key=lambda item: keys[item.path])  # stable: a file's tests keep their order


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(part in _SLOW_FOLDERS for part in Path(str(item.fspath)).parts):
            item.add_marker(pytest.mark.slow)
    if "PYTEST_XDIST_WORKER" in os.environ:  # a worker of -n: the files in schedule order
        _schedule(items)


@pytest.fixture(autouse=True)
def _processes_are_slow(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick check (``-m "not slow"``) stays quick because it starts no process: a test
    that starts one (a subprocess, torchrun, a tracker's service) without the ``slow``
    marker fails here, saying so. DataLoader workers (forked, not started by subprocess)
    are not processes this counts."""
    if request.node.get_closest_marker("slow") is not None:
        return
    import subprocess

    def refuse(self: Any, args: Any, *rest: Any, **options: Any) -> None:
        pytest.fail(f"{request.node.nodeid} starts a process ({args!r:.120}) without the "
                    "'slow' marker: mark it @pytest.mark.slow, so that the quick check "
                    "(python -m pytest -m 'not slow') stays in-process", pytrace=False)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture
def root() -> Path:
    return ROOT


SCRIPTS = sysconfig.get_path("scripts")  # where this interpreter's console scripts are


def console_script(name: str = "hookloop") -> str:
    """The path of an installed console command: the running interpreter's first, so that
    ``venv/bin/python -m pytest`` finds it without the environment being activated."""
    command = shutil.which(name, path=SCRIPTS) or shutil.which(name)
    assert command, f"the {name} console script is not installed: pip install -e ."
    return command


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the checkout importable, one thread each, and this
    interpreter's console scripts first on PATH."""
    env = dict(os.environ)
    env["PATH"] = SCRIPTS + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # W&B puts the address of the wandb-core service it starts into this process's
    # environment; a child that inherits it joins this process's service, where a killed
    # child's run stays open, and its relaunch is refused ("run ID ... is in use"). It
    # happened whenever an in-process W&B test ran earlier in the same pytest session.
    env.pop("WANDB_SERVICE", None)
    return env


def stand_in_scontrol(directory: Path, calls: Path, status: int = 0, output: str = "") -> Path:
    """A stand-in ``scontrol`` in ``directory`` (put it first on PATH) that appends its
    arguments to ``calls`` and prints ``output`` (``scontrol show job``'s answer); with a
    ``status`` other than 0 it says "boom" and fails with it."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "scontrol"
    failing = f'echo "boom" >&2\nexit {status}\n' if status else ""
    printing = f"printf '%s\\n' '{output}'\n" if output else ""  # a builtin: PATH may be bare
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n{printing}{failing}')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


PYTHON = sys.executable

#: The tensor methods that copy a value to the host: on CUDA, each is a device sync.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


@pytest.fixture
def count_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts every host read of a tensor value from here on: ``count_reads["n"]``."""
    counts = {"n": 0}
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _original: Any = original,
                    **kwargs: Any) -> Any:
            counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts
