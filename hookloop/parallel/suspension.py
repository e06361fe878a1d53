"""Ending this launch while the run goes on: the causes, every rank's agreement at one step
boundary, and the exit.

A launch end is asked on one rank or on all of them: a signal (SIGTERM, SIGUSR1, SIGINT
under a batch scheduler; `hookloop.parallel.signals`), `hookloop.callbacks.TimeLimit`, or a callback
calling ``loop.stop(reason, resumable=True)``. Asking changes nothing yet. At every step
boundary of the training pass the ranks vote: each one contributes one flag per cause, and
one all-reduce sums them, so every rank learns the same causes at the same boundary and ends
the training pass there. The checkpoint is then written (collectively when it is sharded),
every ``on_fit_end`` runs, and ``fit`` raises `hookloop.errors.Suspended` with the exit
status of the first agreed cause (`CAUSES` is in that order).

The same flags carry one number rank 0 chooses: `Vote.save_request`, a ticket rank 0 draws
when a save is due by its clock (``Checkpoint(every_n_seconds=...)``) and sends until it
sees it agreed; the other ranks send 0, so the sum is rank 0's ticket, and every rank learns
it (`Vote.agreed_save`) at the same boundary. A new ticket is a save every rank makes at that
boundary; a ticket seen twice (a result read late, or carried again) is the same save, so
none is made twice. Nothing is pending most of the time, and the flags are then zeros made
on the device: no copy from the host.

Which collective carries the flags: under ``DDP`` the gradient all-reduce of the step does
(`carry_on_gradients`, a DDP communication hook appends them to the last gradient bucket),
so the vote costs no collective of its own. Where the step has no all-reduce hookloop owns
(FSDP's reduce-scatter, a process group without DDP, the check before an epoch's first
batch) a dedicated all-reduce of the flags runs at the boundary. On CPU (gloo) the result
is read at once; on CUDA it is copied to the host without waiting and read at the next
step boundary, so that the vote never makes the host wait for the GPU: the launch then ends
one step later, on every rank alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hookloop import distributed
from hookloop.base.checks import check_number

__all__ = ["TimedSaves", "Cause", "CAUSES", "SAVE_TICKETS", "SIGTERM", "SIGUSR1", "SIGINT", "REQUESTED",
           "STOP", "Suspension",
           "Vote", "current", "published", "carry_on_gradients"]


class Cause(NamedTuple):
    """One reason a launch may end resumably, and the exit status it gives the process."""

    name: str
    status: int
    #: How another rank names it in its messages (it knows only that the cause was agreed).
    elsewhere: str


SIGTERM = Cause("SIGTERM", 143, "SIGTERM received by another rank")
SIGUSR1 = Cause("SIGUSR1", 138, "SIGUSR1 received by another rank")
SIGINT = Cause("SIGINT", 130, "SIGINT received by another rank")
REQUESTED = Cause("requested", 75, "a launch end asked on another rank (TimeLimit, "
                                   "loop.stop(resumable=True))")
#: Not a launch end: a stop that ends the run, decided by one rank's clock and agreed by all
#: at one boundary like the others (`hookloop.callbacks.TimeLimit` with no saver in the
#: stack: nothing would let a relaunch continue). Alone, ``fit`` returns; no exit status.
STOP = Cause("stop", 0, "TimeLimit: the time limit was reached on another rank and nothing "
                        "was saved (no Checkpoint in the stack), so a relaunch starts again "
                        "at step 0; add a Checkpoint to continue the run across launches")
#: Every cause, in the order that decides the exit status when several are agreed at once.
CAUSES = (SIGTERM, SIGUSR1, SIGINT, REQUESTED, STOP)
#: `Vote.save_request` tickets run from 1 to this - 1 and round: small integers stay exact in
#: a bfloat16 gradient bucket.
SAVE_TICKETS = 64


class Suspension(NamedTuple):
    """The launch end every rank agreed on: the exit status, why, and the causes by name."""

    status: int
    reason: str
    causes: tuple[str, ...]


_current: list[Vote] = []  # the votes of the fits running in this process, innermost last


class Vote:
    """This rank's launch-end requests, and the ranks' agreement at each step boundary.

    Example:
        >>> vote = Vote()
        >>> vote.agree() is None  # nothing asked
        True
        >>> vote.ask(REQUESTED, "TimeLimit: 2 hours")
        True
        >>> vote.agree()  # one process: agreed at once
        Suspension(status=75, reason='TimeLimit: 2 hours', causes=('requested',))
    """

    __slots__ = ("asked", "save_request", "agreed_save", "_save_pending",
                 "_actions", "_carried", "_host", "_event", "_late", "_alone")

    def __init__(self) -> None:
        #: The causes this rank asked for, with this rank's reason for each.
        self.asked: dict[Cause, str] = {}
        #: Rank 0's last ticket for a save due by the clock: 1 to `SAVE_TICKETS` - 1
        #: (0: none drawn yet).
        self.save_request = 0
        #: The last ticket every rank agreed on (0: none yet); it changes at the boundary
        #: where every rank learns a new one.
        self.agreed_save = 0
        self._save_pending = False  # rank 0 sends save_request until it sees it agreed
        self._actions: list[Callable[[Suspension], None]] = []
        self._carried: torch.Tensor | None = None
        self._host: torch.Tensor | None = None  # pinned: the late read of a CUDA result
        self._event: Any = None
        self._late = False
        self._alone: bool | None = None  # no group to agree over: asked once a fit

    def reset(self) -> None:
        """At every fit start: nothing asked, nothing in flight, no action."""
        self.asked.clear()
        self.save_request = self.agreed_save = 0
        self._save_pending = False
        self._actions.clear()
        self._carried, self._late, self._alone = None, False, None

    def ask(self, cause: Cause, reason: str) -> bool:
        """Ask this rank to end the launch for ``cause``; False when it was asked already."""
        if cause in self.asked:
            return False
        self.asked[cause] = reason
        return True

    def at_end(self, action: Callable[[Suspension], None]) -> None:
        """Call ``action(suspension)`` when this fit ends a launch, after every
        ``on_fit_end`` and before the process exits (a SLURM requeue)."""
        self._actions.append(action)

    def run_actions(self, suspension: Suspension) -> None:
        """Run the actions `at_end` registered (at the end of a suspended fit)."""
        actions, self._actions = list(self._actions), []
        for action in actions:
            action(suspension)

    def ask_save(self) -> bool:
        """On rank 0: ask every rank to save at the coming agreed boundary (a save due by the
        clock). False while the previous request is not agreed yet (it is that save)."""
        if self._save_pending:
            return False
        self.save_request = self.save_request % (SAVE_TICKETS - 1) + 1
        self._save_pending = True
        return True

    def flags(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One element per cause of `CAUSES`: 1 where this rank asked, else 0; then the
        pending `save_request` (0 when none is)."""
        if not self.asked and not self._save_pending:
            return torch.zeros(len(CAUSES) + 1, dtype=dtype, device=device)
        ticket = float(self.save_request) if self._save_pending else 0.0
        return torch.tensor([*(1.0 if cause in self.asked else 0.0 for cause in CAUSES),
                             ticket], dtype=dtype, device=device)

    def carried(self, summed: torch.Tensor) -> None:
        """The flags of every rank, summed by the step's gradient all-reduce."""
        self._carried = summed

    def agree(self) -> Suspension | None:
        """At a step boundary, on every rank: the launch end all ranks agreed on, or None.

        A collective under a process group: every rank calls it at the same boundaries.
        """
        alone = self._alone
        if alone is None:  # at the fit's first boundary: every setup (DDP's) has run
            alone = self._alone = not distributed.is_initialized() or distributed.world_size() == 1
        if alone:
            self._carried = None  # no group to agree over: this process decides alone
            if self._save_pending:
                self.agreed_save, self._save_pending = self.save_request, False
            return self._suspension(set(self.asked)) if self.asked else None
        seen: set[Cause] = set()
        if self._late:  # a CUDA result of the previous boundary: complete by now
            self._late = False
            self._event.synchronize()
            seen |= self._decode(self._host)  # type: ignore[arg-type]  # set with _late
        summed, self._carried = self._carried, None
        if summed is None:
            summed = self._dedicated()
        if summed.device.type == "cpu":
            seen |= self._decode(summed)
        else:
            if self._host is None:
                self._host = torch.empty(len(CAUSES) + 1, dtype=torch.float32,
                                         pin_memory=True)
                self._event = torch.cuda.Event()
            self._host.copy_(summed.float(), non_blocking=True)
            self._event.record()
            self._late = True
        return self._suspension(seen)

    def _decode(self, summed: torch.Tensor) -> set[Cause]:
        """The causes some rank asked for; rank 0's save request becomes `agreed_save`."""
        counts = summed.tolist()
        ticket = round(counts[len(CAUSES)])
        if ticket:
            self.agreed_save = ticket
            if ticket == self.save_request:  # rank 0: seen agreed, sent no more
                self._save_pending = False
        return {cause for cause, count in zip(CAUSES, counts) if count > 0}

    def _dedicated(self) -> torch.Tensor:
        flags = self.flags(torch.float32, distributed.collective_device())
        work = dist.all_reduce(flags, async_op=True)
        work.wait()  # on CUDA the stream waits, not the host
        return flags

    def _suspension(self, causes: set[Cause]) -> Suspension | None:
        agreed = [cause for cause in CAUSES if cause in causes]
        if not agreed:
            return None
        reason = "; ".join(self.asked.get(cause, cause.elsewhere) for cause in agreed)
        return Suspension(agreed[0].status, reason, tuple(cause.name for cause in agreed))




def current() -> Vote | None:
    """The vote of the fit running in this process (the innermost one), or None."""
    return _current[-1] if _current else None


@contextmanager
def published(vote: Vote) -> Iterator[Vote]:
    """Make ``vote`` the `current` one for the block: signals and the gradient hook reach
    the fit through it."""
    _current.append(vote)
    try:
        yield vote
    finally:
        _current.remove(vote)


def carry_on_gradients(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
                       ) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the gradient all-reduce, carrying the vote's flags.

    Averages the gradients as DDP's own all-reduce does (multiply by ``1 / world``, sum);
    the last bucket of a backward also carries one flag per cause, summed, which the
    `current` vote reads at the next step boundary. Registered by ``DDP`` on the models it
    wraps.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer().mul_(1.0 / dist.get_world_size(group))
    vote = current()
    if not bucket.is_last() or vote is None:
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        return future.then(lambda done: done.value()[0])
    size = buffer.numel()
    joined = torch.cat([buffer, vote.flags(buffer.dtype, buffer.device)])

    def split(done: Any) -> torch.Tensor:
        summed = done.value()[0]
        vote.carried(summed[size:])
        return summed[:size]

    return dist.all_reduce(joined, group=group, async_op=True).get_future().then(split)


# DDP checks a hook's annotations against the objects themselves; here they are strings.
carry_on_gradients.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


class TimedSaves:
    """A save every ``every_n_seconds`` of wall time in ``fit`` (Lightning's
    ``train_time_interval``), decided alike on every rank.

    Only rank 0's clock counts: at a step boundary where ``every_n_seconds`` have passed
    since the fit's start or the last save it triggered, rank 0 raises the fit's
    `hookloop.parallel.suspension.Vote.save_request`. The ranks' vote at each step boundary carries
    it (in the gradient all-reduce under DDP, or the vote's own all-reduce), so every rank
    learns it at the same boundary and `due` is True there on all of them: no collective
    and no host sync beyond the vote's. Alone (one process), the save comes at the
    boundary after the one that found the time up.

    Args:
        every_n_seconds: The interval; None: never.
        owner: Who asks (named in errors), e.g. ``"Checkpoint"``.

    Example:
        >>> TimedSaves(None, owner="Checkpoint").due()
        False
    """

    __slots__ = ("every_n_seconds", "_since", "_acted")

    def __init__(self, every_n_seconds: float | None, *, owner: str) -> None:
        self.every_n_seconds = check_number(f"{owner} every_n_seconds", every_n_seconds,
                                            above=0.0, optional=True)
        self._since = time.monotonic()
        self._acted = 0  # the vote's agreed_save this callback saved for last

    def begin(self) -> None:
        """At fit start: the clock counts from now; no request is in flight."""
        self._since, self._acted = time.monotonic(), 0

    def due(self) -> bool:
        """At a step boundary (after the loop recorded it): save now? The same on every rank."""
        vote = current()
        if self.every_n_seconds is None or vote is None:
            return False
        if vote.agreed_save != self._acted:  # every rank learnt it at this boundary
            self._acted, self._since = vote.agreed_save, time.monotonic()
            return True
        if distributed.is_main() and time.monotonic() - self._since >= self.every_n_seconds:
            vote.ask_save()  # agreed at a coming boundary (a second ask waits for it)
        return False

    def at_boundary(self, step: int, every_n_steps: int | None) -> bool:
        """At a step boundary: save now, because the time is up (`due`, asked at every
        boundary since it reads the vote) or every ``every_n_steps`` optimizer steps?"""
        timed = self.due()
        return timed or bool(every_n_steps is not None and step and step % every_n_steps == 0)
