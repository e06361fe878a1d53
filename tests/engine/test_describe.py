"""describe() stays readable at 80 columns for large stacks: presets.debug() +
presets.standard(...) is 15 callbacks; every callback keeps its column and its marks."""
from __future__ import annotations

import re

import pytest

from hookloop import Callback, presets
from hookloop import describe
from hookloop.base.events import HOOKS, Event
from hookloop.engine.ordering import overrides

from builders import accuracy


def check_every_column(callbacks: list[Callback], text: str) -> None:
    assert max(map(len, text.splitlines())) <= 80, text
    assert "…" not in text, text  # nothing cut off
    headers = []
    for line in text.splitlines():
        if line.startswith("┃ event"):
            headers += re.findall(r"\d+", line)
    assert headers == [str(i) for i in range(len(callbacks))], text  # each once, in order
    for event in [event.value for event in Event] + list(HOOKS):
        rows = [line for line in text.splitlines() if line.startswith(f"│ {event} ")]
        cells = [cell.strip() for row in rows for cell in row.split("│")[2:-1]]
        assert len(cells) == len(callbacks), (event, text)
        turn = 0
        for callback, cell in zip(callbacks, cells):  # the turns count over the whole stack
            if overrides(callback, event):
                turn += 1
                assert cell == str(turn), (event, callback, text)
            else:
                assert cell == "", (event, callback, text)


def test_debug_plus_standard_keeps_every_column_at_80() -> None:
    callbacks = presets.debug(steps=10) + presets.standard(
        metrics={"acc": accuracy}, monitor="val_acc", accumulate=2)
    assert len(callbacks) == 15
    text = describe(callbacks, print_table=False)
    check_every_column(callbacks, text)
    assert text.count("┃ event") == 2  # two tables of 8 and 7 callbacks
    for index, callback in enumerate(callbacks):
        assert f"{index}: {callback!r}" in text


class Listener(Callback):
    def on_fit_start(self, loop):
        pass


@pytest.mark.parametrize("count", [1, 9, 10, 11, 25, 120])
def test_any_stack_size_fits_80_columns(count: int) -> None:
    callbacks: list[Callback] = [Listener() if i % 2 else Callback() for i in range(count)]
    check_every_column(callbacks, describe(callbacks, print_table=False))
