"""SIGTERM (hookloop/parallel/signals.py): inside fit it asks to end the launch at the next step
boundary, where the checkpoint is written, and the process exits with status 143; the
program's own handler is left alone; and a Terminated raised while another exception is
being handled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint
from hookloop.parallel.signals import handled
from hookloop.parallel.suspension import Vote, published

from builders import RaiseAtBatch, shuffled_run
from conftest import subprocess_env


def test_sigterm_inside_fit_asks_to_end_the_launch_and_the_handler_is_restored() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    assert previous is signal.SIG_DFL
    with published(Vote()) as vote, handled():
        installed = signal.getsignal(signal.SIGTERM)
        assert installed is not signal.SIG_DFL
        with handled():  # nested: installs nothing more
            assert signal.getsignal(signal.SIGTERM) is installed
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):  # the handler runs here, raising nothing
                pass
        assert [cause.name for cause in vote.asked] == ["SIGTERM"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_program_handler_for_sigterm_is_left_alone() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with published(Vote()) as vote, handled():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):
                pass
        assert seen == [signal.SIGTERM] and not vote.asked
    finally:
        signal.signal(signal.SIGTERM, previous)


SIGTERM_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    from torch import nn
    from hookloop import Callback, Loop
    from hookloop.callbacks import Checkpoint

    class Preempt(Callback):
        def on_batch_end(self, loop):
            if loop.state.step == 5 and not loop.state.epoch and {send}:
                os.kill(os.getpid(), signal.SIGTERM)

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(8)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[Preempt(), Checkpoint(sys.argv[1], resume=True)])
    try:
        loop.fit(2)
    finally:
        print("finally ran", flush=True)
    torch.save(model.state_dict(), os.path.join(sys.argv[1], "..", "final.pt"))
""")


@pytest.mark.slow
def test_sigterm_during_fit_leaves_a_resumable_checkpoint_and_exits_143(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"

    def run(send: bool, where: Path) -> subprocess.CompletedProcess[str]:
        script = tmp_path / f"train_{send}.py"
        script.write_text(SIGTERM_SCRIPT.replace("{send}", str(send)))
        return subprocess.run([sys.executable, str(script), str(where)], env=subprocess_env(),
                              capture_output=True, text=True, timeout=120, check=False)

    first = run(True, directory)
    assert first.returncode == 143, first.stderr[-3000:]
    assert "finally ran" in first.stdout and "SIGTERM received" in first.stderr
    assert "Traceback" not in first.stderr
    assert sorted(path.name for path in directory.iterdir()) == ["epoch=0000-step=00000005.pt"]
    second = run(False, directory)  # the relaunch resumes and finishes
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    resumed = torch.load(tmp_path / "final.pt", weights_only=True)
    uninterrupted = tmp_path / "plain"
    assert run(False, uninterrupted).returncode == 0
    expected = torch.load(tmp_path / "final.pt", weights_only=True)
    for name in expected:
        assert torch.equal(resumed[name], expected[name]), name


def test_a_sigterm_while_handling_an_exception_lets_the_others_finish(tmp_path: Path) -> None:
    from hookloop import Terminated

    class Preempted(Callback):  # SIGTERM arrives while the first handler runs
        def on_exception(self, loop: Loop, exc: BaseException) -> None:
            raise Terminated()

    class Closes(Callback):
        closed = False

        def on_fit_end(self, loop: Loop) -> None:
            Closes.closed = True

    _, loop = shuffled_run([Preempted(), RaiseAtBatch(0, 5, RuntimeError, event="after_forward"),
                            Closes(), Checkpoint(tmp_path)])
    with pytest.raises(Terminated) as caught:
        loop.fit(2)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert Closes.closed  # every on_fit_end ran
    assert [path.name for path in tmp_path.glob("epoch=*.pt")] == ["epoch=0000-step=00000005.pt"]


WORKERS_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from torch.utils.data import DataLoader, TensorDataset
    from hookloop import Callback, Loop
    from hookloop.callbacks import Checkpoint

    class Slow(Callback):
        def on_batch_end(self, loop):
            if loop.state.step == 3:
                print("ready", flush=True)
            time.sleep(0.05)

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = DataLoader(TensorDataset(torch.randn(400, 3), torch.randn(400, 1)), batch_size=4,
                      num_workers=2)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=torch.nn.functional.mse_loss, device="cpu",
                callbacks=[Slow(), Checkpoint(sys.argv[1])])
    loop.fit(2)
""")


@pytest.mark.slow
def test_sigterm_to_the_whole_job_spares_the_dataloader_workers(tmp_path: Path) -> None:
    """A scheduler signals every process of the job: the workers must not die of it (their
    death would raise in the main process at any line, on the exception path)."""
    script = tmp_path / "train.py"
    script.write_text(WORKERS_SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt")],
                               env=subprocess_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        os.killpg(process.pid, signal.SIGTERM)  # the main process and its workers
        _, errors = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 143, errors[-3000:]
    assert "killed by signal" not in errors and "Traceback" not in errors, errors[-3000:]
    assert len(list((tmp_path / "ckpt").glob("epoch=0000-step=*.pt"))) == 1


PERSISTENT_WORKERS_SCRIPT = textwrap.dedent("""
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from hookloop import Loop

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    def loader():
        return DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4,
                          num_workers=2, persistent_workers=True)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), loader(),
                val_data=loader(), loss_fn=torch.nn.functional.mse_loss, device="cpu")
    loop.fit(1)
    print("fit returned", flush=True)
""")


@pytest.mark.slow
def test_a_script_that_ends_right_after_a_fit_with_persistent_workers_exits(
        tmp_path: Path) -> None:
    """multiprocessing's exit handler terminates the persistent workers and joins them: a
    worker still in the grace after the fit ignored that SIGTERM, and the process never
    exited. The timeout is the hang detector (the script itself takes seconds)."""
    script = tmp_path / "train.py"
    script.write_text(PERSISTENT_WORKERS_SCRIPT)
    try:
        done = subprocess.run([sys.executable, str(script)], env=subprocess_env(),
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as hang:
        pytest.fail(f"the process did not exit after its fit: {hang.stdout!r}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fit returned" in done.stdout


@pytest.mark.slow
def test_a_script_that_ends_right_after_a_fit_with_persistent_workers_exits_quietly(
        tmp_path: Path) -> None:
    """At the exit, multiprocessing terminates the persistent workers. Torch's own SIGTERM
    handler ends a worker its parent signals with status 0; the handler that spares the
    workers during a fit replaced it and ended them by the signal, so the main process
    printed "DataLoader worker (pid N) is killed by signal: Terminated." (status 0 still),
    at most exits of such a script. 12 runs, four at a time: none may print a traceback."""
    from concurrent.futures import ThreadPoolExecutor

    script = tmp_path / "train.py"
    script.write_text(PERSISTENT_WORKERS_SCRIPT)

    def run(_: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script)], env=subprocess_env(),
                              capture_output=True, text=True, timeout=240)

    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(run, range(12)))
    noisy = [done.stderr for done in runs if done.returncode != 0 or "Traceback" in done.stderr
             or "killed by signal" in done.stderr]
    assert all("fit returned" in done.stdout for done in runs)
    assert not noisy, f"{len(noisy)} of 12 exits failed or printed a traceback:\n{noisy[0]}"
