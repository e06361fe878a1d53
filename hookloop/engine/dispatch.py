"""Emitting events: the dispatch table, the exception path, and which loop a callback is in.

The table is built once per fit: for each event, the methods callbacks really override, so
an event nobody listens to costs nothing. Emitting is one loop over a tuple; the events of
every batch (`INLINE`) are looped over by the loop itself, with no call of `Table.emit`
(about 500 instructions per listening handler, where a call of `emit` per event cost as
much again). An exception from a callback gets a note naming the callback and the event:
from `Table.emit` at once, from an inline event on the exception path of ``fit``
(`Table.annotate_inline`). When ``fit`` fails, every
``on_exception`` and then every ``on_fit_end`` still runs (they save, close files and
process groups); their own errors become notes on the first exception.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Optional, cast

from hookloop.base.events import Event
from hookloop.callback import Callback
from hookloop.engine.ordering import overrides
from hookloop.errors import ConfigurationError, Terminated

__all__ = ["Table", "MaybeTable", "Wrapper", "Handlers", "add_note", "annotate", "bind",
           "INLINE", "NULL_CONTEXT", "listens"]


class _NullContext:
    """A context that does nothing, in C: ``with`` calls ``"".format()`` when it enters and
    ``"".format(type, value, traceback)`` when it leaves, which return ``""`` (false, so an
    exception goes on). ``contextlib.nullcontext`` costs two Python calls per ``with``, and
    the loop enters one twice per batch when no callback gives a context."""

    __slots__ = ()
    __enter__ = "".format
    __exit__ = "".format


_NULL_CONTEXT: Any = _NullContext()
#: A context that does nothing and costs no Python call (``with x if hooks else NULL_CONTEXT``).
NULL_CONTEXT: Any = _NULL_CONTEXT
_LISTS = tuple(event.value for event in Event) + (
    "forward_context", "train_step_context", "validation_context", "scale_loss", "setup")

#: The per-batch events the loop calls inline (``for handler in table.<event>: handler(loop)``).
INLINE = frozenset(("on_batch_start", "after_forward", "after_backward", "before_step",
                    "after_step", "on_batch_end"))

#: The events whose handlers `Table.annotate_inline` names: the per-batch ones and
#: ``scale_loss``, which the loop also calls inline (``loss = handler(loop, loss)``).
_NAMED_INLINE = (*sorted(INLINE), "scale_loss")

Handlers = tuple[Callable[..., Any], ...]
Wrapper = Callable[[Callback, str, Callable[..., Any]], Callable[..., Any]]


class Table:
    """Event -> tuple of bound methods, built once per fit; an unheard event is ``()``.

    ``step`` is the one callback method that routes the optimizer step, or None.
    ``wrap(callback, name, method) -> callable``, when given, replaces every method in the
    table (a profiler or a tracer); without it the table holds the bound methods themselves.
    ``main=False`` (a rank other than 0) leaves out the ``rank_zero_only`` callbacks.

    ``host`` is what every handler is called with (the loop, to the callbacks): the table
    holds it as it is, and never looks inside it. `emit`, `call`, `entered`, `emit_fit_end`
    and `handle_exception` hand it to the handlers (of this table or of another one).
    """

    __slots__ = _LISTS + ("step", "host")

    if TYPE_CHECKING:  # the event lists, set by name in __init__ (one per event and hook)

        def __getattr__(self, name: str) -> Handlers: ...

    def __init__(self, callbacks: Sequence[Callback], host: object, wrap: Wrapper | None = None,
                 *, main: bool = True) -> None:
        def entry(callback: Callback, name: str) -> Callable[..., Any]:
            method = getattr(callback, name)
            return method if wrap is None else wrap(callback, name, method)

        callbacks = [callback for callback in callbacks if main or not callback.rank_zero_only]

        for name in _LISTS:
            setattr(self, name, tuple(entry(c, name) for c in callbacks if listens(c, name)))
        routers = [c for c in callbacks if listens(c, "optimizer_step")]
        self.step = entry(routers[0], "optimizer_step") if routers else None
        self.host = host

    def entered(self, hooks: Handlers) -> AbstractContextManager[Any]:
        """One context made of what the ``*_context`` hooks return (None is skipped)."""
        if not hooks:
            return _NULL_CONTEXT
        if len(hooks) == 1:  # `_make` inline: one call less at every batch (AMP's autocast)
            hook = hooks[0]
            try:
                context = hook(self.host)
            except BaseException as exc:
                annotate(exc, hook)
                raise
            return _NULL_CONTEXT if context is None else context
        return _stacked(hooks, self.host)

    def emit(self, handlers: Handlers) -> None:
        """Call every handler of one event with the host, naming the callback if one raises."""
        host = self.host
        for handler in handlers:
            try:
                handler(host)
            except BaseException as exc:
                annotate(exc, handler)
                raise

    def emit_recording(self, handlers: Handlers, record: Callable[[], None]) -> None:
        """`emit`, with ``record()`` after each handler: what a handler wrote (an epoch's
        metrics) is in the record for the handlers after it."""
        for handler in handlers:
            self.emit((handler,))
            record()

    def call(self, hook: Callable[..., Any], *args: Any) -> Any:
        """Call one hook (``setup``, ``scale_loss``, ``optimizer_step``...) with the host,
        naming it on error."""
        try:
            return hook(self.host, *args)
        except BaseException as exc:
            annotate(exc, hook)
            raise

    def emit_fit_end(self, failure: BaseException | None) -> None:
        """Every ``on_fit_end`` runs, even after one raised (they close files, groups...).

        With ``failure`` (fit is already raising), their errors become notes on it;
        otherwise the first error is raised once all have run. Ctrl-C stops at once.
        """
        first: BaseException | None = None
        for handler in self.on_fit_end:
            try:
                handler(self.host)
            except KeyboardInterrupt:
                raise
            except Exception as error:
                annotate(error, handler)
                note = f"hookloop: {_owner(handler)}.on_fit_end also raised {error!r}"
                if failure is not None:
                    add_note(failure, note)
                elif first is None:
                    first = error
                else:
                    add_note(first, note)
        if first is not None:
            raise first

    def annotate_inline(self, exc: BaseException) -> None:
        """`annotate` for an exception that a handler of an `INLINE` event (or ``scale_loss``)
        raised: the frame that called it holds it as ``handler``, the loop variable of every
        inline loop, and the next frame of the traceback runs its code. Nothing when no such
        handler raised it, or when it is noted already (`emit` notes at once)."""
        if getattr(exc, "_hookloop_noted", False):
            return
        trace = exc.__traceback__
        while trace is not None and trace.tb_next is not None:
            handler = trace.tb_frame.f_locals.get("handler")
            function = getattr(handler, "__func__", handler)
            # The frame called it (a loop variable outlives its loop: the callee must match).
            if getattr(function, "__code__", None) is trace.tb_next.tb_frame.f_code:
                for name in _NAMED_INLINE:
                    if any(handler is listed for listed in getattr(self, name)):
                        annotate(exc, cast(Callable[..., Any], handler), name)
                        return
            trace = trace.tb_next

    def handle_exception(self, exc: BaseException) -> Terminated | None:
        """The exception path of ``fit``: every ``on_exception``, then every ``on_fit_end``.

        A handler's own error becomes a note on ``exc`` and the others still run; a second
        Ctrl-C stops at once. A SIGTERM that arrives meanwhile lets the others finish and is
        returned, so ``fit`` exits as SIGTERM with ``exc`` as its cause.
        """
        self.annotate_inline(exc)
        terminated: Terminated | None = None
        for handler in self.on_exception:
            try:
                handler(self.host, exc)
            except KeyboardInterrupt:
                raise  # a second Ctrl-C while handling the first: stop at once
            except Terminated as signal:  # preempted while handling: finish, then exit
                terminated = terminated or signal
                add_note(exc, f"hookloop: SIGTERM arrived during {_owner(handler)}.on_exception")
            except Exception as error:  # keep going: the first exception is what matters
                add_note(exc, f"hookloop: {_owner(handler)}.on_exception also raised {error!r}")
        self.emit_fit_end(exc)
        return terminated


#: A table, or None where none is built yet (the loop's before its first fit).
MaybeTable = Optional[Table]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; Python 3.10 has no ``add_note``: the same ``__notes__`` list
    (PEP 678), which 3.10's traceback does not print, but which a reader of ``exc`` finds."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        setattr(exc, "__notes__", [*getattr(exc, "__notes__", []), note])


def listens(callback: Callback, name: str) -> bool:
    """Whether ``callback`` is called at event ``name``: it overrides the method, and does not
    name the event in its ``_silent_events`` (read when the table is built, after ``setup``:
    a view whose settings make a per-batch method a no-op, as TensorBoard's graph tracing
    when ``graph=False``, costs no call per batch)."""
    return overrides(callback, name) and name not in getattr(callback, "_silent_events", ())


def annotate(exc: BaseException, handler: Callable[..., Any], event: str | None = None) -> None:
    """Name the callback and the event (``handler``'s name unless given) on an exception,
    once, keeping its traceback."""
    if not getattr(exc, "_hookloop_noted", False):
        owner = type(getattr(handler, "__self__", None)).__name__
        event = event or getattr(handler, "__name__", "?")
        add_note(exc, f"hookloop: raised in callback {owner} at event {event}")
        try:
            exc._hookloop_noted = True  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - exceptions with __slots__
            pass


def _make(hook: Callable[..., Any], host: object) -> Any:
    try:
        return hook(host)
    except BaseException as exc:
        annotate(exc, hook)
        raise


@contextmanager
def _stacked(hooks: Handlers, host: object) -> Iterator[None]:
    with ExitStack() as stack:  # exits those entered so far if a later one fails
        for hook in hooks:
            context = _make(hook, host)
            if context is not None:
                stack.enter_context(context)
        yield


def _owner(handler: Callable[..., Any]) -> str:
    return type(getattr(handler, "__self__", None)).__name__


def bind(callbacks: Sequence[Callback], owner: object) -> None:
    """A callback belongs to the first loop (``owner``) it runs in (it holds that run's state).

    Raises:
        ConfigurationError: a callback already ran in another loop.
    """
    for callback in callbacks:
        held = getattr(callback, "_hookloop_loop", None)
        if held is not None and held() is not owner:
            raise ConfigurationError(
                f"{callback!r} already ran in another Loop. A callback holds the state of "
                "one run (counters, averages, schedules, best scores), so it stays with the "
                f"loop it first ran in. Create a new {type(callback).__name__}(...) for this "
                "loop: build the list in a function, or call the preset again.")
    for callback in callbacks:
        try:
            callback._hookloop_loop = weakref.ref(owner)  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - a callback with __slots__
            pass
