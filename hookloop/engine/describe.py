"""`describe`: the table of which callback runs at which event, in firing order."""

from __future__ import annotations

import io
from collections.abc import Sequence

from hookloop.base.events import HOOKS, Event
from hookloop.callback import Callback
from hookloop.engine.ordering import overrides

__all__ = ["describe"]

#: Width of the text returned (and printed): readable in an 80-column terminal.
WIDTH = 80


def describe(callbacks: Sequence[Callback], *, print_table: bool = True) -> str:
    """Print a table of events (rows, in firing order) by callbacks (columns, in list order).

    Columns are headed by the callback's index in the list; a legend under the table names
    each index (its ``repr``), so event names and callbacks stay whole at 80 columns. A
    cell holds the position of that callback among the listeners of the event (1 runs
    first). Rows after the events are the hooks that change how the loop works. A stack
    too wide for 80 columns (about ten callbacks or more) is shown as several tables, one
    after the other, each with the event column and the next callbacks' columns.

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

    rows = [event.value for event in Event] + list(HOOKS)
    cells = _turns(callbacks, rows)
    event_width = max(map(len, rows))
    cell_width = len(str(len(callbacks)))  # the widest index or turn
    # A table is "│ event │ c │ c │...│": the event column takes event_width + 3 characters,
    # each callback column cell_width + 3, the closing border 1.
    per_table = max(1, (WIDTH - (event_width + 3) - 1) // (cell_width + 3))
    count = max(1, -(-len(callbacks) // per_table))
    size = max(1, -(-len(callbacks) // count))  # tables of even widths: 15 callbacks give 8 + 7
    chunks = [range(start, min(start + size, len(callbacks)))
              for start in range(0, len(callbacks), size)] or [range(0)]
    caption = "a cell: the callback's turn among those listening (1 runs first)"
    tables = []
    for number, chunk in enumerate(chunks):
        title = "hookloop: who runs at which event"
        if len(chunks) > 1:
            title = (f"{title} ({number + 1}/{len(chunks)})" if number == 0 else
                     f"callbacks {chunk[0]}-{chunk[-1]} ({number + 1}/{len(chunks)})")
        table = Table(title=title, show_lines=False, padding=(0, 1),
                      caption=caption if len(chunks) == 1 else None)
        table.add_column("event", style="bold", no_wrap=True, min_width=event_width)
        for index in chunk:
            table.add_column(str(index), justify="center", no_wrap=True, min_width=cell_width)
        for row in rows:
            if row == HOOKS[0]:
                table.add_section()
            listening = any(cells[row])
            table.add_row(row, *(cells[row][index] for index in chunk),
                          style=None if listening else "dim")
        tables.append(table)
    legend = Text((caption + "\n" if len(chunks) > 1 else "") + _legend(callbacks))
    renderable = Group(*tables, legend) if callbacks else tables[0]
    buffer = io.StringIO()
    Console(file=buffer, width=WIDTH, color_system=None).print(renderable)
    if print_table:
        Console().print(renderable)
    return buffer.getvalue()


def _turns(callbacks: Sequence[Callback], rows: Sequence[str]) -> dict[str, list[str]]:
    """For each row (event or hook), each callback's turn among those listening ("1" runs
    first), or "" for one that does not listen; counted over the whole stack."""
    cells: dict[str, list[str]] = {}
    for row in rows:
        order, cells[row] = 0, []
        for callback in callbacks:
            if overrides(callback, row):
                order += 1
                cells[row].append(str(order))
            else:
                cells[row].append("")
    return cells


def _legend(callbacks: Sequence[Callback]) -> str:
    """One line per callback: its index and ``repr`` (and whether it runs on rank 0 only)."""
    return "".join(f"{index}: {callback!r}{' (rank 0 only)' if callback.rank_zero_only else ''}\n"
                   for index, callback in enumerate(callbacks))
