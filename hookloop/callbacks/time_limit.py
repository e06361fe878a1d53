"""End the launch before its wall-clock budget runs out, with time left for the save."""

from __future__ import annotations

import datetime
import os
import time
from typing import TYPE_CHECKING, Any, cast

from hookloop import distributed
from hookloop.base.checks import check_choice, check_duration, check_number
from hookloop.base.clock import process_start
from hookloop.callback import Callback
from hookloop.errors import ConfigurationError
from hookloop.parallel import slurm, suspension

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["TimeLimit"]


class TimeLimit(Callback):
    """End this launch resumably before ``duration`` has passed, leaving time for the save.

    For jobs with a wall-time limit (SLURM's ``--time``, a reservation, a CI slot). The
    budget counts from the start of this process, as the scheduler's clock does: the
    interpreter's start, torch's import and a slow setup before this callback was created
    count too (`hookloop.base.clock.process_start`). Under SLURM, ``TimeLimit()`` with no
    duration reads the job's end time (`hookloop.parallel.slurm.job_end_time`), so the budget
    is what is left of the job's ``--time``: ``SLURM_JOB_END_TIME`` when it is set, else
    ``squeue`` (else ``scontrol``), asked once, by rank 0 when the fit starts; every rank
    takes its answer, and a failure is the same `ConfigurationError` on every rank (no rank
    waits for another that failed alone). At every step boundary the launch is ended with
    ``loop.stop(reason, resumable=True)`` when the time left is less than the reserve:

    * the longest time between two step boundaries of this launch (the next step may still
      run before every rank agrees; a validation or a save between two steps counts), plus
    * the save: ``margin`` seconds if given, else twice the duration of the last checkpoint
      save of this fit (each `Checkpoint` in the stack measures its own, from its start to a
      complete file, `Checkpoint.last_save_seconds`; with several, their sum; any
      callback that offers ``last_save_seconds`` counts, so another package's saver can);
      before the first save that part is 0, so pass ``margin`` when the end of the launch
      may come before any periodic save.

    Every rank agrees on that step boundary, `Checkpoint` saves it, every ``on_fit_end``
    runs, and ``fit`` raises `hookloop.errors.Suspended` (exit status 75). Relaunched
    with the same command, the run continues exactly; each launch gets the whole budget
    again (this callback keeps no state across launches), counted from the relaunched
    process's start. (Or let SLURM time it: ``--signal=USR1@90`` and ``DDP(requeue=True)``.)

    Without a saver in the stack (no callback offers ``last_save_seconds``: no
    `Checkpoint`), a relaunch could not continue the run: it would start again at step 0,
    and a requeueing cluster would do so forever. So the limit then ends the run, not the
    launch: every rank stops at one agreed step boundary, every ``on_fit_end`` runs, and
    ``fit`` returns (no `Suspended`, no exit status 75), saying that the time limit was
    reached and nothing was saved (a time cap on a run is legitimate; add a `Checkpoint` to
    continue it across launches instead).

    Args:
        duration: The budget from the process's start: seconds, a ``datetime.timedelta``,
            or SLURM's time forms (``"4:00:00"``, ``"1-12:00:00"``, ``"90"`` for 90
            minutes). None (default): the SLURM job's end time (`duration` is None until
            the fit starts when squeue is asked for it).
        margin: Seconds kept for the final save; None measures it (twice the last save).
        start: ``"process"`` (default): the budget counts from this process's start;
            ``"created"``: from this callback's creation, for launches that run one after
            another in one process (a notebook, a relaunch loop in Python).

    Raises:
        ConfigurationError: a duration that is not > 0, a SLURM time with a field out of
            its range (``"00:75"``), or a negative margin; no duration outside a SLURM job;
            at fit start, on every rank, no duration in a job whose end time cannot be
            read.
        CallbackOrderError: at fit start, a second ``TimeLimit`` in the stack (one budget
            per launch: keep the one you mean).

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(10)]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[TimeLimit("4:00:00")])
        >>> loop.fit(2).step  # far from the limit: nothing changes
        hookloop: training ended at epoch 2/2, step 20: all 2 epochs are done.
        20
    """

    unique = True  # two budgets in one stack: the shorter would silently decide

    def __init__(self, duration: float | datetime.timedelta | str | None = None, *,
                 margin: float | None = None, start: str = "process") -> None:
        self.margin = check_number("TimeLimit margin", margin, minimum=0.0, optional=True)
        self.start = check_choice(
            "TimeLimit start", start, ("process", "created"),
            hint="'process': the budget counts from the process's start, as a scheduler "
                 "counts a job's time; 'created': from this callback's creation (launches "
                 "run one after another in one process, a notebook).")
        #: Where the budget counts from (``time.monotonic()``): the process's start, or
        #: this callback's creation with ``start="created"``.
        self.started = process_start() if start == "process" else time.monotonic()
        # The SLURM job's end is asked at fit start (rank 0, once), every rank agreeing.
        self._ask_job, self._job_end = False, cast(float | None, None)
        #: Seconds from the budget's start to its end (None: the SLURM job's end, not asked
        #: yet).
        self.duration: float | None = None
        if duration is not None:
            self.duration = check_duration("TimeLimit duration", duration)
        elif (end := self._job_end_from_environment()) is not None:
            self.duration = self._budget_until(end)
        else:
            self._ask_job = True
        self._longest = 0.0
        self._last = self.started
        self._savers: list[Any] = []  # the stack's savers, asked for their saves' durations

    def __repr__(self) -> str:
        start = "" if self.start == "process" else f", start={self.start!r}"
        duration = "None" if self.duration is None else f"{self.duration:g}"
        return f"TimeLimit({duration}, margin={self.margin!r}{start})"

    def _job_end_from_environment(self) -> float | None:
        """``SLURM_JOB_END_TIME`` (None: squeue must be asked); no SLURM job is refused now,
        alike on every rank (they share the environment)."""
        if not os.environ.get("SLURM_JOB_ID"):
            raise _no_job_end("this process is not in a SLURM job (no SLURM_JOB_ID)")
        return slurm.job_end_time(ask=False)

    def _budget_until(self, end: float) -> float:
        """Seconds from the budget's start to ``end`` (Unix time)."""
        return max(end - time.time() + time.monotonic() - self.started, 0.0)

    def _asked_job_end(self) -> float | str:
        """The SLURM job's end asked of squeue/scontrol (once, kept), or why it is unknown."""
        if self._job_end is None:
            try:
                self._job_end = slurm.job_end_time()
            except Exception as error:  # said on every rank, not raised on this one alone
                return str(_no_job_end(f"asking squeue for it failed on rank "
                                       f"{distributed.rank()}: {error!r}"))
        if self._job_end is None:
            return str(_no_job_end(
                "SLURM_JOB_END_TIME is not set and neither squeue nor scontrol told the end "
                f"time of job {os.environ.get('SLURM_JOB_ID')}"))
        return self._job_end

    def _agree_on_job_end(self) -> None:
        """At fit start: rank 0 asks for the job's end, every rank takes its answer."""
        alone = distributed.world_size() == 1  # no group (torchrun's rank without one too)
        answer = distributed.broadcast_object(
            self._asked_job_end() if alone or distributed.is_main() else None)
        if isinstance(answer, str):
            raise ConfigurationError(answer)
        self._job_end, self._ask_job = answer, False
        self.duration = self._budget_until(cast(float, answer))

    def _known_duration(self) -> float:
        """`duration`; before the fit that asks squeue, asked now on this rank alone."""
        if self.duration is None:
            answer = self._asked_job_end()
            if isinstance(answer, str):
                raise ConfigurationError(answer)
            self.duration = self._budget_until(answer)  # the fit start still agrees on it
        return self.duration

    @property
    def elapsed(self) -> float:
        """Seconds of the budget spent: since the process started (or, with
        ``start="created"``, since this callback was created)."""
        return time.monotonic() - self.started

    def time_elapsed(self) -> float:
        """Seconds of the budget used so far (`elapsed`), e.g. for a log line or a decision.

        Example:
            >>> limit = TimeLimit("1:00:00")
            >>> 0.0 <= limit.time_elapsed() < limit.duration
            True
        """
        return self.elapsed

    def time_remaining(self) -> float:
        """Seconds of the budget left: ``duration - time_elapsed()``, 0 once it is spent.

        Before the fit of a ``TimeLimit()`` whose job's end squeue must tell, this rank asks
        it now (the fit start still agrees on rank 0's answer).

        Example:
            >>> limit = TimeLimit("1:00:00")
            >>> 0.0 < limit.time_remaining() <= 3600.0
            True
        """
        return max(self._known_duration() - self.elapsed, 0.0)

    def reserve(self) -> float:
        """Seconds the end of the launch needs: the longest step interval and the save."""
        last_save = sum(saver.last_save_seconds or 0.0 for saver in self._savers)
        save = self.margin if self.margin is not None else 2.0 * last_save
        return self._longest + save

    def on_fit_start(self, loop: Loop) -> None:
        if self._ask_job:  # alike on every rank: no rank had SLURM_JOB_END_TIME
            self._agree_on_job_end()
        self._last = time.monotonic()
        # The interface a saver offers (Checkpoint does; a callback of another package may):
        # ``last_save_seconds``, its last save's duration or None. Callbacks stay leaves.
        self._savers = [callback for callback in loop.callbacks
                        if hasattr(type(callback), "last_save_seconds")]

    def on_batch_end(self, loop: Loop) -> None:
        if not loop.state.step_boundary:
            return
        now = time.monotonic()
        self._longest = max(self._longest, now - self._last)
        self._last = now
        left, reserve = self._known_duration() - (now - self.started), self.reserve()
        if left > reserve:
            return
        left_of = f"{max(left, 0.0):.1f} s of {self.duration:g} s left"
        # Asked again until all agree: the vote keeps the first reason.
        if self._savers:
            loop.stop(f"TimeLimit: {left_of}, {reserve:.1f} s kept for the last step and the "
                      "save", resumable=True)
            return
        # Nothing saves the run: a relaunch could not continue it, so the run ends here
        # (exit 75 would make a requeueing cluster start it again at step 0 forever).
        reason = (f"TimeLimit: the time limit was reached ({left_of}) and nothing was saved "
                  "(no Checkpoint in the stack), so a relaunch starts again at step 0; add a "
                  "Checkpoint to continue the run across launches")
        vote = suspension.current()
        if vote is None:  # not inside a fit's launch (a test driving the hook by hand)
            loop.stop(reason, force=True)
        else:  # every rank stops at one boundary, as for a launch end
            vote.ask(suspension.STOP, reason)


def _no_job_end(where: str) -> ConfigurationError:
    return ConfigurationError(
        f"TimeLimit() without a duration reads the SLURM job's end time, but {where}. "
        "Pass the budget: TimeLimit('3:50:00') (the job's --time).")
