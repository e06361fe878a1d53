"""The dispatch table: for each event, the methods that callbacks really override."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

from hookloop.callback import Callback
from hookloop.events import Event
from hookloop.ordering import overrides

__all__ = ["Table", "Wrapper", "annotate", "entered"]

_NULL_CONTEXT = nullcontext()
_LISTS = tuple(event.value for event in Event) + (
    "forward_context", "train_step_context", "validation_context", "scale_loss")

Handlers = tuple[Callable[..., Any], ...]
Wrapper = Callable[[Callback, str, Callable[..., Any]], Callable[..., Any]]


class Table:
    """Event -> tuple of bound methods, built once per fit; an unheard event is ``()``.

    ``step`` is the one callback method that routes the optimizer step, or None.
    ``wrap(callback, name, method) -> callable``, when given, replaces every method in the
    table (a profiler or a tracer); without it the table holds the bound methods themselves.
    """

    __slots__ = _LISTS + ("step",)

    def __init__(self, callbacks: Sequence[Callback], wrap: Wrapper | None = None) -> None:
        def entry(callback: Callback, name: str) -> Callable[..., Any]:
            method = getattr(callback, name)
            return method if wrap is None else wrap(callback, name, method)

        for name in _LISTS:
            setattr(self, name, tuple(entry(c, name) for c in callbacks if overrides(c, name)))
        routers = [c for c in callbacks if overrides(c, "optimizer_step")]
        self.step = entry(routers[0], "optimizer_step") if routers else None


def annotate(exc: BaseException, handler: Callable[..., Any]) -> None:
    """Name the callback and the event on an exception, once, keeping its traceback."""
    if not getattr(exc, "_hookloop_noted", False):
        owner = type(getattr(handler, "__self__", None)).__name__
        event = getattr(handler, "__name__", "?")
        exc.add_note(f"hookloop: raised in callback {owner} at event {event}")
        try:
            exc._hookloop_noted = True  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - exceptions with __slots__
            pass


def entered(hooks: Handlers, loop: Any) -> AbstractContextManager[Any]:
    """One context made of what the ``*_context`` hooks return (None is skipped)."""
    if not hooks:
        return _NULL_CONTEXT
    if len(hooks) == 1:
        context = _make(hooks[0], loop)
        return _NULL_CONTEXT if context is None else context
    return _stacked(hooks, loop)


def _make(hook: Callable[..., Any], loop: Any) -> Any:
    try:
        return hook(loop)
    except BaseException as exc:
        annotate(exc, hook)
        raise


@contextmanager
def _stacked(hooks: Handlers, loop: Any) -> Iterator[None]:
    with ExitStack() as stack:  # exits those entered so far if a later one fails
        for hook in hooks:
            context = _make(hook, loop)
            if context is not None:
                stack.enter_context(context)
        yield
