"""Ending a launch while the run goes on (hookloop/parallel/suspension.py, RunEnd): in one process a
resumable stop, a signal or a vote ends training at the next step boundary, Checkpoint
saves that step, on_fit_end runs, fit raises Suspended with the cause's status, and the
relaunch ends with the weights of an uninterrupted run (torch.equal)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from hookloop import Callback, Loop, Suspended, Terminated
from hookloop.callbacks import Checkpoint, GradAccumulation
from hookloop.parallel.suspension import REQUESTED, SIGTERM, SIGUSR1, Suspension, Vote

from builders import EventRecorder, Signal, StopAt, dropout_loop, same_weights, weights


class SeesTheEnd(Callback):
    def on_fit_end(self, loop: Loop) -> None:
        self.resumable = loop.stop_resumable
        self.reason = loop.stop_reason


def _files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("*.pt"))


def _uninterrupted(epochs: int, **options: object) -> dict[str, torch.Tensor]:
    loop = dropout_loop([], **options)
    loop.fit(epochs)
    return weights(loop)


def _relaunch(directory: Path, epochs: int, *callbacks: Callback) -> Loop:
    loop = dropout_loop([*callbacks, Checkpoint(directory, every_n_epochs=None, resume=True)])
    loop.fit(epochs)
    return loop


def test_the_vote_gives_the_status_of_the_first_cause_and_names_the_others() -> None:
    vote = Vote()
    assert vote.ask(REQUESTED, "TimeLimit: 1 hour") and vote.ask(SIGUSR1, "SIGUSR1 received")
    assert not vote.ask(SIGUSR1, "again")  # asked once
    assert vote.agree() == Suspension(138, "SIGUSR1 received; TimeLimit: 1 hour",
                                      ("SIGUSR1", "requested"))
    vote.ask(SIGTERM, "SIGTERM received")
    assert vote.agree().status == 143
    vote.reset()
    assert vote.agree() is None


def test_suspended_is_a_system_exit_and_terminated_is_a_suspended() -> None:
    assert isinstance(Suspended("x"), SystemExit) and not isinstance(Suspended(), Exception)
    assert Suspended().code == 75 and Terminated().code == 143
    assert isinstance(Terminated(), Suspended)


def test_a_resumable_stop_saves_its_step_ends_the_launch_and_the_relaunch_continues(
        tmp_path: Path) -> None:
    recorder, sees = EventRecorder(), SeesTheEnd()
    loop = dropout_loop([StopAt(3, resumable=True), recorder, sees,
                         Checkpoint(tmp_path, every_n_epochs=None, resume=True)])
    with pytest.raises(Suspended) as ended:
        loop.fit(3)
    assert ended.value.code == 75 and "stop at step 3" in str(ended.value)
    assert loop.state.step == 3 and sees.resumable and sees.reason == "stop at step 3"
    labels = recorder.labels("on_epoch_end", "on_fit_end", "on_exception")
    assert labels == ["on_epoch_end", "on_fit_end"]  # a clean end, not the exception path
    assert _files(tmp_path) == ["epoch=0000-step=00000003.pt"]
    saved = torch.load(tmp_path / "epoch=0000-step=00000003.pt", weights_only=True)
    assert saved["loop"]["ended"] is None  # the run goes on
    resumed = _relaunch(tmp_path, 3)
    assert resumed.state.step == 12
    expected = _uninterrupted(3)
    assert same_weights(resumed, expected)


def test_a_plain_stop_ends_the_run_and_returns() -> None:
    sees = SeesTheEnd()
    loop = dropout_loop([StopAt(3), sees])
    loop.fit(3)  # no Suspended: the run ended
    assert loop.state.step == 3 and not sees.resumable and not loop.stop_resumable


def test_a_resumable_stop_inside_an_accumulation_window_waits_for_its_end(
        tmp_path: Path) -> None:
    class AskMidWindow(Callback):
        def on_batch_end(self, loop: Loop) -> None:
            if (loop.state.epoch, loop.state.batch_idx) == (0, 2):  # batch 3 of window 2
                loop.stop("mid window", resumable=True)

    loop = dropout_loop([GradAccumulation(2), AskMidWindow(),
                         Checkpoint(tmp_path, every_n_epochs=None)], batches=6)
    with pytest.raises(Suspended):
        loop.fit(2)
    assert loop.state.step == 2 and loop.position == (0, 4, 2)  # the window was finished
    assert _files(tmp_path) == ["epoch=0000-step=00000002.pt"]


def test_an_end_asked_after_the_epoch_s_last_step_still_saves_and_resumes(
        tmp_path: Path) -> None:
    # Asked during the epoch-end validation: agreed before epoch 1's first batch, which
    # ends epoch 1 there, so its on_epoch_end (where Checkpoint saves) runs.
    recorder = EventRecorder()
    loop = dropout_loop([StopAt(4, "on_validation_end", resumable=True), recorder,
                         Checkpoint(tmp_path, every_n_epochs=None, resume=True)])
    with pytest.raises(Suspended):
        loop.fit(3)
    ends = [event[1:2] + event[3:] for event in recorder.events if event[0] == "on_epoch_end"]
    assert ends == [(0, 4), (1, 4)] and loop.state.step == 4  # (epoch, step)
    assert _files(tmp_path) == ["epoch=0001-step=00000004.pt"]
    resumed = _relaunch(tmp_path, 3)
    expected = _uninterrupted(3)
    assert same_weights(resumed, expected)


def test_an_end_agreed_at_the_run_s_last_step_leaves_the_run_ended(tmp_path: Path) -> None:
    loop = dropout_loop([StopAt(8, resumable=True),
                         Checkpoint(tmp_path, every_n_epochs=None)])
    loop.fit(2)  # nothing is left to continue: no Suspended
    saved = torch.load(tmp_path / "epoch=0001-step=00000008.pt", weights_only=True)
    assert saved["loop"]["ended"]["reason"] == "all 2 epochs are done"


@pytest.mark.parametrize(("name", "status"), [("SIGTERM", 143), ("SIGUSR1", 138)])
def test_a_signal_inside_fit_ends_the_launch_with_its_status(tmp_path: Path, name: str,
                                                             status: int) -> None:
    loop = dropout_loop([Signal(2, getattr(signal, name)), Checkpoint(tmp_path)])
    with pytest.raises(Suspended) as ended:
        loop.fit(2)
    assert ended.value.code == status and loop.state.step == 2
    assert _files(tmp_path) == ["epoch=0000-step=00000002.pt"]
    assert signal.getsignal(getattr(signal, name)) is signal.SIG_DFL  # put back


def test_sigint_outside_a_scheduler_s_job_stays_a_keyboard_interrupt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID"):
        monkeypatch.delenv(variable, raising=False)
    loop = dropout_loop([Signal(2, signal.SIGINT)])
    with pytest.raises(KeyboardInterrupt):
        loop.fit(2)
    assert loop.state.step == 2


def test_sigint_in_a_scheduler_s_job_ends_the_launch_and_twice_stops_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    loop = dropout_loop([Signal(2, signal.SIGINT), Checkpoint(tmp_path / "once")])
    with pytest.raises(Suspended) as ended:
        loop.fit(2)
    assert ended.value.code == 130 and loop.state.step == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    class Twice(Signal):
        def on_batch_end(self, loop: Loop) -> None:
            super().on_batch_end(loop)
            if self.sent and loop.state.step == self.step:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again: at once
                time.sleep(0.05)

    recorder = EventRecorder()
    loop = dropout_loop([Twice(2, signal.SIGINT), recorder])
    with pytest.raises(KeyboardInterrupt):
        loop.fit(2)
    assert recorder.labels("on_exception") == ["on_exception:KeyboardInterrupt"]


def test_a_save_ticket_rides_on_the_flags_and_a_duplicate_is_the_same_save() -> None:
    """Issue 28, item 6: rank 0 sends its ticket until it sees it agreed, then zeros (made
    on the device, no host copy); a ticket delivered twice (late, or carried again) leaves
    ``agreed_save`` where it was, so a consumer saves once."""
    from hookloop.parallel.suspension import CAUSES

    zero, one = Vote(), Vote()
    for vote in (zero, one):
        vote._alone = False  # as under a process group: the sums come from the flags
    assert zero.ask_save() and not zero.ask_save()  # a second ask waits for the first
    sent = zero.flags(torch.float32, torch.device("cpu")) + one.flags(torch.float32,
                                                                      torch.device("cpu"))
    assert sent.tolist() == [0.0] * len(CAUSES) + [1.0]
    seen = []
    for summed in (sent, sent.clone(), torch.zeros_like(sent)):  # the ticket, again, none
        for vote in (zero, one):
            vote.carried(summed)
            assert vote.agree() is None
        seen.append((zero.agreed_save, one.agreed_save))
    assert seen == [(1, 1), (1, 1), (1, 1)]
    assert zero.flags(torch.float32, torch.device("cpu")).tolist() == [0.0] * (len(CAUSES) + 1)
    assert zero.ask_save() and zero.save_request == 2  # the next save, a new ticket
