"""`describe`: the table of which callback runs at which event, in firing order."""

from __future__ import annotations

import io
from collections.abc import Sequence

from hookloop.callback import Callback
from hookloop.events import HOOKS, Event
from hookloop.ordering import overrides

__all__ = ["describe"]


def describe(callbacks: Sequence[Callback], *, print_table: bool = True) -> str:
    """Print a table of events (rows, in firing order) by callbacks (columns, in list order).

    A cell holds the position of that callback among the listeners of the event (1 runs
    first). Rows after the events are the hooks that change how the loop works.

    Args:
        callbacks: A callback stack, as given to `Loop`.
        print_table: Print the table to the terminal (rich); set False to only get the text.

    Returns:
        The table as plain text.

    Example:
        >>> from hookloop import Callback, describe
        >>> class Hello(Callback):
        ...     def on_fit_start(self, loop):
        ...         print("hello")
        >>> "on_fit_start" in describe([Hello()], print_table=False)
        True
    """
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hookloop: who runs at which event", show_lines=False)
    table.add_column("event", style="bold")
    for index, callback in enumerate(callbacks):
        header = f"{index}: {callback!r}"
        if callback.rank_zero_only:
            header += " (rank 0 only)"
        table.add_column(header, justify="center")
    rows = [event.value for event in Event] + list(HOOKS)
    for row in rows:
        if row == HOOKS[0]:
            table.add_section()
        cells, order = [], 0
        for callback in callbacks:
            if overrides(callback, row):
                order += 1
                cells.append(str(order))
            else:
                cells.append("")
        table.add_row(row, *cells, style=None if order else "dim")
    buffer = io.StringIO()
    Console(file=buffer, width=max(100, 34 + 22 * len(callbacks)), color_system=None).print(table)
    if print_table:
        Console().print(table)
    return buffer.getvalue()
