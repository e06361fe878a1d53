"""README.md and every page under docs/ render as their author meant (issue 28, item 1).

A page is parsed with markdown-it-py (CommonMark with GitHub's tables, the parser rich
uses): every code fence closes where the author closed it, and every block of ``|`` rows
becomes a table. A closing fence with text after it (```` ``` more text````) is no
closing fence, so the block runs on and the tables below it render as code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from conftest import ROOT

DOCUMENTS = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")])


def _parser() -> MarkdownIt:
    return MarkdownIt("commonmark").enable("table")


def problems(text: str) -> list[str]:
    """What does not render as written: fences left open, ``|`` rows that are no table."""
    lines = text.splitlines()
    tokens = _parser().parse(text)
    found: list[str] = []
    in_code: set[int] = set()
    tabled: set[int] = set()
    for token in tokens:
        if token.map is None:
            continue
        start, end = token.map
        if token.type in ("fence", "code_block"):
            in_code.update(range(start, end))
        if token.type == "table_open":
            tabled.update(range(start, end))
        if token.type != "fence":
            continue
        marker = token.markup
        closing = lines[end - 1].strip() if end - 1 > start else ""
        if not (closing.startswith(marker) and set(closing) == {marker[0]}):
            found.append(f"line {start + 1}: the code fence opened here is never closed")
        for number in range(start + 1, end - 1):  # the block's own lines
            line = lines[number].lstrip()
            if line.startswith(marker) and len(line) - len(line.lstrip(marker[0])) >= len(marker):
                found.append(f"line {number + 1}: {line[:40]!r} looks like a fence but does "
                             f"not close the block opened at line {start + 1} (text after a "
                             "closing fence, or a fence the block before forgot to close)")
    row_block: list[int] = []
    for number, line in enumerate([*lines, ""]):
        if number not in in_code and line.lstrip().startswith("|"):
            row_block.append(number)
            continue
        if row_block and not set(row_block) <= tabled:
            found.append(f"line {row_block[0] + 1}: {len(row_block)} '|' rows that do not "
                         "parse as a table (a header, then a |---| row, a blank line before)")
        row_block = []
    return found


def test_the_checker_finds_an_unclosed_fence_and_a_lost_table() -> None:
    broken = ("text\n\n```python\nx = 1\n``` more text\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    found = problems(broken)
    assert any("line 5" in problem and "looks like a fence" in problem for problem in found)
    assert any("never closed" in problem for problem in found)
    fixed = broken.replace("``` more text", "```\n\nmore text")
    assert problems(fixed) == []
    lost = problems("text\n\n| a | b |\n| 1 | 2 |\n")  # no delimiter row: a paragraph
    assert len(lost) == 1 and "line 3: 2 '|' rows" in lost[0]
    assert problems("````markdown\n```python\nx\n```\n````\n") == []  # a longer outer fence


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_fence_closes_and_every_table_parses(document: Path) -> None:
    assert problems(document.read_text(encoding="utf-8")) == []


def test_the_lightning_guide_has_its_three_tables() -> None:
    tokens = _parser().parse((ROOT / "docs/migration/lightning.md").read_text(encoding="utf-8"))
    assert sum(token.type == "table_open" for token in tokens) >= 3


def test_the_lightning_stack_has_tensorboard_before_checkpoint_the_order_that_works(
        tmp_path: Path) -> None:
    """The guide's stack logs to TensorBoard (a Lightning habit) in the order hookloop
    accepts; the habit of listing the checkpoint first is refused before training."""
    import torch
    import torch.nn.functional as F

    from hookloop import CallbackOrderError, Loop
    from hookloop.callbacks import Checkpoint, TensorBoard

    page = (ROOT / "docs/migration/lightning.md").read_text(encoding="utf-8")
    stack = page.split("callbacks = [", 1)[1].split("\n]", 1)[0]
    assert 0 <= stack.index("TensorBoard(") < stack.index("Checkpoint(")
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1))]
    refused = [Checkpoint(tmp_path / "ckpt"), TensorBoard(tmp_path / "runs")]
    with pytest.raises(CallbackOrderError, match="Move TensorBoard before Checkpoint"):
        Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
             device="cpu", callbacks=refused).fit(1)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
