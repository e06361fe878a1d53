"""Whether and why the run ended (`RunEnd`), and the launch around a fit: the signals it
takes, the ranks' vote on ending it, and the exit of a launch that ends while the run goes
on."""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from hookloop import distributed
from hookloop.engine.data import worker_queues_kept
from hookloop.errors import ConfigurationError, Suspended, Terminated, expect_field, expect_int
from hookloop.parallel import signals
from hookloop.parallel.suspension import REQUESTED, SIGTERM, STOP, Suspension, Vote, published
from hookloop.runfile.format import LOOP, register_check

if TYPE_CHECKING:
    from hookloop.engine.position import Position
    from hookloop.engine.state import LoopState

__all__ = ["KEYS", "RunEnd", "say"]

# ``loop``: the run's length, whether and why it ended (``ended``: its reason, epochs and
# max_steps), and a stop held for ``min_epochs``/``min_steps``. Written, checked and read here.
EPOCHS, MAX_STEPS, ENDED, STOP_HELD = "epochs", "max_steps", "ended", "stop_held"
REASON = "reason"  # of ``ended``
KEYS = (EPOCHS, MAX_STEPS, ENDED, STOP_HELD, REASON)
#: Keys that are also ordinary words elsewhere (``fit``'s arguments, the loop state's fields).
SHARED_WORDS = frozenset((EPOCHS, MAX_STEPS))


def say(line: str) -> None:
    """Print one of the loop's own lines; on a terminal, broken between words at its width
    and the rest indented (a terminal cuts a longer line at its last column, mid-word)."""
    isatty = getattr(sys.stdout, "isatty", None)  # a stand-in stdout may have none
    if isatty is not None and isatty():
        line = textwrap.fill(line, max(40, shutil.get_terminal_size().columns),
                             subsequent_indent="  ", break_long_words=False,
                             break_on_hyphens=False)
    print(line, flush=True)


class RunEnd:
    """Whether and why the run ended: a stop, its epochs or ``max_steps``; whether this
    launch ends while the run goes on (a `Suspension`); and the end the run being resumed
    recorded, which decides whether a relaunch trains at all.

    A run that ended stays ended when relaunched with the same command: a fit with the same
    ``epochs`` (and no larger ``max_steps``) trains nothing and says why; a larger
    ``epochs``, or a larger or absent ``max_steps``, continues it. A suspended launch
    records no end: the relaunch continues where it stopped.
    """

    # No __slots__: its `reason` is also a key of the file (`REASON`).
    def __init__(self, state: LoopState, position: Position,
                 total_steps: Callable[[], int | None] = lambda: None) -> None:
        self._state, self._position = state, position  # the loop's: step, epochs done...
        # The fit's steps in all, asked after setup (DDP and GradAccumulation set them).
        self._total_steps = total_steps
        #: `Loop.stop` was called in this fit, or every rank agreed to end the launch.
        self.requested = False
        #: The reason given to it.
        self.reason: str | None = None
        #: The end recorded by the state being restored (None: it had not ended).
        self.restored: Mapping[str, Any] | None = None
        #: This fit had nothing to train (it said so before on_fit_start).
        self.idle = False
        #: The launch end every rank agreed on in this fit (None: none).
        self.suspension: Suspension | None = None
        self._keeper: Any = None  # `worker_queues_kept`'s, of the last fit
        #: The reason of a stop asked before ``min_epochs``/``min_steps`` were reached: it
        #: takes effect at the first boundary where they are (None: no stop is held).
        self.held: str | None = None
        #: The ranks' vote on ending the launch, asked by signals and resumable stops.
        self.vote = Vote()

    def begin(self) -> None:
        """At every fit start: no stop requested (or held) yet."""
        self.requested, self.reason, self.suspension, self.held = False, None, None, None

    def stop(self, reason: str | None, *, resumable: bool = False, force: bool = False) -> None:
        if resumable:  # takes effect where every rank agrees (see `due`)
            self.vote.ask(REQUESTED, reason or "loop.stop(resumable=True) was called")
        elif force or self.minimum_reached():
            self.requested, self.reason = True, reason
        elif self.held is None:  # the first reason is kept, as a stop keeps its own
            self.held = reason or "loop.stop() was called"
            if distributed.is_main():
                say(f"hookloop: {self.held.rstrip('.')}; {self._minimum()} is not reached "
                    f"({self._position.epoch} epochs done, step {self._state.step}): "
                    "training goes on until it is, then stops.")

    def minimum_reached(self) -> bool:
        """``fit(min_epochs=..., min_steps=...)`` are reached: epochs completed (at the
        last boundary) and optimizer steps taken. Counted alike on every rank."""
        state = self._state
        return ((state.min_epochs is None or self._position.epoch >= state.min_epochs)
                and (state.min_steps is None or state.step >= state.min_steps))

    def _minimum(self) -> str:
        state = self._state
        parts = [f"min_epochs={state.min_epochs}" if state.min_epochs else "",
                 f"min_steps={state.min_steps}" if state.min_steps else ""]
        return " and ".join(part for part in parts if part)

    def release(self) -> bool:
        """`requested`, once a held stop took effect (the minimum is reached). Asked at every
        boundary and by ``loop.stop_requested``, so the epoch end that reaches ``min_epochs``
        already sees the stop (``Checkpoint`` saves the stopped run there)."""
        if self.held is not None and not self.requested and self.minimum_reached():
            reason = f"{self.held.rstrip('.')} (held until {self._minimum()} was reached)"
            self.requested, self.reason, self.held = True, reason, None
        return self.requested

    def due(self) -> bool:
        """True when training must end: a stop (a held one once the minimum is reached),
        ``max_steps``, or an agreed launch end."""
        state = self._state
        return self.release() or (state.max_steps is not None and state.step >= state.max_steps)

    def due_at_boundary(self) -> bool:
        """`due` at a step boundary of the training pass, where the ranks also vote on
        ending the launch (a collective under a process group: every rank asks at the same
        boundaries), or on a `STOP` (agreed alone: a plain stop, the run ends). An end
        agreed before an epoch's first batch ends that epoch there, so its ``on_epoch_end``
        (where `Checkpoint` saves) still runs."""
        state = self._state  # `due` inlined: asked at every boundary of every batch
        if (self.release() if self.held is not None else self.requested) or (
                state.max_steps is not None and state.step >= state.max_steps):
            return True
        agreed = self.vote.agree()
        if agreed is not None and agreed.causes == (STOP.name,):  # the run ends, agreed
            self.requested, self.reason = True, agreed.reason
        elif agreed is not None:
            self.requested, self.reason, self.suspension = True, agreed.reason, agreed
            if distributed.is_main():
                say(f"hookloop: ending this launch at step {self._state.step} "
                    f"({agreed.reason}); the process exits with status {agreed.status} "
                    "once the checkpoint is written.")
        return self.requested

    def check_steps(self) -> None:
        """After a step: stop once ``max_steps`` is reached."""
        state = self._state
        if state.max_steps is not None and state.step >= state.max_steps:
            self.stop(f"max_steps={state.max_steps} reached", force=True)

    @contextmanager
    def launch(self, *loaders: Any) -> Iterator[None]:
        """Around a fit: signals ask `vote` (the ``loaders``' workers ignore them); a fit
        that ended the launch raises `Suspended` once it returned (every ``on_fit_end``
        ran), unless the run ended at that boundary too (its last epoch), which leaves
        nothing to continue."""
        self.vote.reset()
        try:
            with published(self.vote), signals.handled() as taken, \
                    signals.sparing_workers(loaders, taken):
                yield
        finally:  # the loaders' workers stop at once when the loop is collected
            with suppress(Exception):  # never in place of the fit's own exception
                self._keeper = worker_queues_kept(self._keeper, self, *loaders,
                                                  self._position.live)
        suspension, state = self.suspension, self._state
        if suspension is None or not self._goes_on():
            return
        # The epoch's live iterator goes now: its DataLoader workers stop through their
        # queues, not by a signal at the interpreter's exit (a later fit replays instead).
        self._position.rewind()
        self.vote.run_actions(suspension)
        signals.quiet_until_exit(taken)
        message = (f"this launch ended at step {state.step} ({suspension.reason}); the run "
                   "goes on: relaunch the same command to continue it")
        if suspension.status == SIGTERM.status:
            raise Terminated(message)
        raise Suspended(message, suspension.status)

    def _goes_on(self) -> bool:
        """This launch ended (a suspension) and the run did not: it continues in the next."""
        state = self._state
        return self.suspension is not None and self.record(
            state.epochs, state.max_steps, self._position.epoch) is None

    def record(self, epochs: int, max_steps: int | None, epochs_done: int) -> dict[str, Any] | None:
        """Why the run ended (for `Loop.state_dict`), or None while it goes on."""
        if self.requested and self.suspension is None:
            reason = self.reason or "loop.stop() was called"
        elif epochs and epochs_done >= epochs:
            reason = _all_epochs(epochs)
        else:
            return None
        return {REASON: reason, EPOCHS: epochs, MAX_STEPS: max_steps}

    # ------------------------------------------------------------ its part of the run file
    def state_dict(self) -> dict[str, Any]:
        """``loop``'s epochs, max_steps, ended and stop_held (`hookloop.loop.Loop.state_dict`)."""
        state = self._state
        return {LOOP: {EPOCHS: state.epochs, MAX_STEPS: state.max_steps,
                       ENDED: self.record(state.epochs, state.max_steps, self._position.epoch),
                       STOP_HELD: self.held}}  # a stop waiting for min_epochs/min_steps

    @staticmethod
    def check_file(source: str, saved: Mapping[str, Any]) -> None:
        """The run's length and end have their types (run on every resume file read)."""
        part = saved[LOOP]
        expect_int(source, f"{LOOP}.{EPOCHS}", part.get(EPOCHS, 0))
        expect_int(source, f"{LOOP}.{MAX_STEPS}", part.get(MAX_STEPS), 1, optional=True)
        if part.get(STOP_HELD) is not None:
            expect_field(source, f"{LOOP}.{STOP_HELD}", part[STOP_HELD],
                         isinstance(part[STOP_HELD], str), "a str (a held stop's reason)")
        ended = part.get(ENDED)
        if ended is None:
            return
        where = f"{LOOP}.{ENDED}"
        expect_field(source, where, ended, isinstance(ended, Mapping),
                     f"None or a dict with {REASON!r} and {EPOCHS!r}")
        expect_field(source, f"{where}.{REASON}", ended.get(REASON),
                     isinstance(ended.get(REASON), str), "a str")
        expect_int(source, f"{where}.{EPOCHS}", ended.get(EPOCHS))
        expect_int(source, f"{where}.{MAX_STEPS}", ended.get(MAX_STEPS), 1, optional=True)

    def check(self, saved: Mapping[str, Any], source: str) -> None:
        self.check_file(source, saved)

    def load_state_dict(self, saved: Mapping[str, Any], source: str = "") -> None:
        """The end the saved run recorded: it decides whether the next fit trains."""
        self.restored, self.held = saved[LOOP].get(ENDED), saved[LOOP].get(STOP_HELD)

    def nothing_to_train(self, epochs: int, max_steps: int | None, epochs_done: int,
                         step: int) -> str | None:
        """Why this fit trains nothing (said once, before on_fit_start), or None.

        When there is a reason, the fit is stopped with it (``stop_requested`` is True).
        """
        reason = self._idle_reason(epochs, max_steps, epochs_done, step)
        self.idle = reason is not None
        if reason is None:
            self._check_reachable(epochs, max_steps)
        if reason is not None:
            self.stop(reason, force=True)
        return reason

    def _check_reachable(self, epochs: int, max_steps: int | None) -> None:
        """Refuse ``fit(min_steps=...)`` above the steps the fit can take: a held stop adds
        no step, so the minimum would never be reached (and a stop never honoured)."""
        minimum, total = self._state.min_steps, self._total_steps()
        if minimum is None or total is None or minimum <= total:
            return
        more = f"epochs >= {-(-minimum * epochs // max(total, 1))}"  # max_steps >= min_steps
        raise ConfigurationError(
            f"fit min_steps={minimum} can never be reached: this fit takes {total} optimizer "
            f"steps in all (fit({epochs}{f', max_steps={max_steps}' if max_steps else ''}), "
            "with the batches per epoch, accumulation and ranks it has), and holding a stop "
            f"adds no step. Pass {more}, or a min_steps of at most {total}.")

    def announce(self) -> None:
        """At the end of a fit that trained: rank 0 prints one line saying why it ended,
        with the epoch numbered as the progress display numbers it (from 1)."""
        state = self._state
        if self.idle or not distributed.is_main():
            return
        why = (self.reason or "loop.stop() was called") if self.requested else \
            _all_epochs(state.epochs)
        if self._goes_on():
            say(f"hookloop: this launch ended at epoch {state.epoch + 1}/{state.epochs}, "
                f"step {state.step}: {why.rstrip('.')}; the run goes on, relaunch the same "
                "command to continue it.")
            return
        say(f"hookloop: training ended at epoch {state.epoch + 1}/{state.epochs}, step "
            f"{state.step}: {why.rstrip('.')}.")

    def _idle_reason(self, epochs: int, max_steps: int | None, epochs_done: int,
                     step: int) -> str | None:
        ended, self.restored = self.restored, None
        if ended is not None:
            more_epochs = epochs > int(ended[EPOCHS])
            more_steps = ended.get(MAX_STEPS) is not None and (
                max_steps is None or max_steps > int(ended[MAX_STEPS]))
            if not (more_epochs or more_steps):
                return (f"the run being resumed already ended ({ended[REASON]}), so this fit "
                        f"trains nothing. Pass a larger epochs than {ended[EPOCHS]} to continue "
                        "it, or start a new run.")
        if epochs and epochs_done >= epochs:
            return (f"all {epochs} epochs of this run are done, so this fit trains nothing; "
                    f"pass a larger epochs than {epochs} to train more.")
        if max_steps is not None and step >= max_steps:
            return (f"max_steps={max_steps} is already reached (step {step}), so "
                    "this fit trains nothing; pass a larger max_steps or none.")
        return None


def _all_epochs(epochs: int) -> str:
    return "its 1 epoch is done" if epochs == 1 else f"all {epochs} epochs are done"


register_check(RunEnd.check_file)
