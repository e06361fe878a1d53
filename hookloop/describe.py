"""`describe`: the table of which callback runs at which event, in firing order."""

from __future__ import annotations

import io
from collections.abc import Sequence

from hookloop.callback import Callback
from hookloop.events import HOOKS, Event
from hookloop.ordering import overrides

__all__ = ["describe"]

#: Width of the text returned (and printed): readable in an 80-column terminal.
WIDTH = 80


def describe(callbacks: Sequence[Callback], *, print_table: bool = True) -> str:
    """Print a table of events (rows, in firing order) by callbacks (columns, in list order).

    Columns are headed by the callback's index in the list; a legend under the table names
    each index (its ``repr``), so event names and callbacks stay whole at 80 columns. A
    cell holds the position of that callback among the listeners of the event (1 runs
    first). Rows after the events are the hooks that change how the loop works.

    Args:
        callbacks: A callback stack, as given to `Loop`.
        print_table: Print the table to the terminal (rich); set False to only get the text.

    Returns:
        The table and its legend as plain text, at most 80 characters a line (a legend
        line may wrap when a callback's ``repr`` is longer).

    Example:
        >>> from hookloop import Callback, describe
        >>> class Hello(Callback):
        ...     def on_fit_start(self, loop):
        ...         print("hello")
        >>> text = describe([Hello()], print_table=False)
        >>> "on_fit_start" in text and "0: Hello()" in text
        True
    """
    from rich.console import Console, Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="hookloop: who runs at which event", show_lines=False, padding=(0, 1),
                  caption="a cell: the callback's turn among those listening (1 runs first)")
    rows = [event.value for event in Event] + list(HOOKS)
    table.add_column("event", style="bold", no_wrap=True, min_width=max(map(len, rows)))
    for index, _ in enumerate(callbacks):
        table.add_column(str(index), justify="center", no_wrap=True)
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
    legend = Text()
    for index, callback in enumerate(callbacks):
        line = f"{index}: {callback!r}"
        if callback.rank_zero_only:
            line += " (rank 0 only)"
        legend.append(line + "\n")
    renderable = Group(table, legend) if callbacks else table
    buffer = io.StringIO()
    Console(file=buffer, width=WIDTH, color_system=None).print(renderable)
    if print_table:
        Console().print(renderable)
    return buffer.getvalue()
