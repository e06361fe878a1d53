"""The `Event` docstring is the loop in pseudocode: recorded event traces must follow it.

The pseudocode is read as a grammar: an event name is itself, a ``for`` block repeats, an
``if`` block may be left out, and ``validate(...)`` stands for the block defined under
``validate(limit=None):``. Real fits (with the sanity check, step and epoch validations,
accumulation, a cancelled step, a stop) are recorded and must match it exactly.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, Event, Loop
from hookloop.callbacks import GradAccumulation

EVENT_NAMES = {event.value for event in Event} - {"on_exception"}  # its own tests cover it
_CALL = re.compile(r"^(\w+)\(.*\)(:?)$")


def _blocks() -> list[tuple[int, str, list]]:
    """The pseudocode as a tree of ``(indent, code, children)``; comments (after two or
    more spaces) are dropped."""
    code = Event.__doc__.split("::", 1)[1].splitlines()
    lines = []
    for line in code[1:]:
        if line.strip() and len(line) - len(line.lstrip()) < 8:
            break  # the paragraph after the code block
        if line.strip():
            lines.append((len(line) - len(line.lstrip()), re.split(r"\s{2,}", line.strip())[0]))
    root: list = []
    stack = [(-1, root)]
    for indent, text in lines:
        while stack[-1][0] >= indent:
            stack.pop()
        node = (indent, text, [])
        stack[-1][1].append(node)
        stack.append((indent, node[2]))
    return root


def _grammar() -> re.Pattern[str]:
    tree = _blocks()
    definitions: dict[str, list] = {}

    def collect(nodes: list) -> None:
        for _, text, children in nodes:
            match = _CALL.match(text)
            if match and match.group(2) and match.group(1) != "fit":
                definitions[match.group(1)] = children
            collect(children)

    collect(tree)

    def compile_(nodes: list) -> str:
        parts = []
        for _, text, children in nodes:
            match = _CALL.match(text)
            if text.startswith(("for ", "while ")):
                parts.append(f"(?:{compile_(children)})*")
            elif text.startswith("if "):
                parts.append(f"(?:{compile_(children)})?")
            elif match and match.group(1) in definitions:
                parts.append(compile_(definitions[match.group(1)]))
            elif match and match.group(1) == "fit":
                parts.append(compile_(children))
            elif text in EVENT_NAMES:
                parts.append(re.escape(text) + " ")
        return "".join(parts)

    return re.compile(compile_(tree))


class Recorder(Callback):
    """Hears every event, the sanity check's too (it produces a metric)."""

    def __init__(self) -> None:
        self.trace: list[str] = []

    def produces(self, loop):
        return ("val_heard",)

    def on_validation_end(self, loop):
        loop.state.metrics["val_heard"] = 1.0
        self.trace.append("on_validation_end")


for _event in EVENT_NAMES - {"on_validation_end"}:
    setattr(Recorder, _event, lambda self, loop, _name=_event: self.trace.append(_name))


class CancelSecondStep(Callback):
    def before_step(self, loop):
        if loop.state.step == 1 and not getattr(self, "done", False):
            self.done = True
            loop.cancel_step()


class StopInSecondEpoch(Callback):
    def on_batch_end(self, loop):
        if loop.state.epoch == 1 and loop.state.batch_idx == 1:
            loop.stop("enough")


def _trace(extra: list[Callback], **options) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    train = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(5)]
    val = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(2)]
    recorder = Recorder()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), train, val_data=val,
                loss_fn=F.cross_entropy, callbacks=[*extra, recorder], device="cpu", **options)
    loop.fit(3)
    return " ".join(recorder.trace) + " "


@pytest.mark.parametrize("extra, options", [
    ([], {}),
    ([], {"val_every_n_steps": 2, "sanity_val_batches": 1}),
    ([GradAccumulation(2)], {"val_every_n_steps": 2, "val_every_n_epochs": 2}),
    ([CancelSecondStep()], {"sanity_val_batches": 0}),
    ([StopInSecondEpoch()], {"val_every_n_steps": 3}),
], ids=["plain", "step-validation", "accumulation", "cancelled-step", "stop"])
def test_recorded_traces_follow_the_event_docstring(extra, options) -> None:
    trace = _trace(extra, **options)
    assert _grammar().fullmatch(trace), trace


def test_the_grammar_rejects_a_trace_in_another_order() -> None:
    trace = _trace([], val_every_n_steps=2)
    assert _grammar().fullmatch(trace)
    swapped = trace.replace("after_forward after_backward", "after_backward after_forward", 1)
    assert not _grammar().fullmatch(swapped)
    late_sanity = trace.replace("on_fit_start on_validation_start", "on_validation_start "
                                "on_fit_start", 1)
    assert not _grammar().fullmatch(late_sanity)
