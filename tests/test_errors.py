"""Generated messages take the article their names need: "Create an Adam", "an SGD"
(issue 19, item 12)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from hookloop import CheckpointError, Loop
from hookloop.callbacks import Checkpoint
from hookloop.errors import with_article

ARTICLE_BEFORE_A_VALUE = re.compile(r"(^|\W)(a|an|A|An)\s+$")


def articles_before_values(source: str) -> list[int]:
    """Lines of f-strings that write a fixed "a " or "an " before a formatted value."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.JoinedStr):
            continue
        for before, after in zip(node.values, node.values[1:]):
            if (isinstance(before, ast.Constant) and isinstance(before.value, str)
                    and isinstance(after, ast.FormattedValue)
                    and ARTICLE_BEFORE_A_VALUE.search(before.value)):
                lines.append(node.lineno)
    return lines


@pytest.mark.slow
def test_no_message_writes_a_fixed_article_before_a_name() -> None:
    found = {path.relative_to(ROOT).as_posix(): lines
             for path in sorted((ROOT / "hookloop").rglob("*.py"))
             if (lines := articles_before_values(path.read_text(encoding="utf-8")))}
    assert found == {}, ("use hookloop.errors.with_article(name) instead of a fixed 'a '/'an ' "
                         f"before a value: {found}")


def test_the_scan_finds_what_it_looks_for() -> None:
    assert articles_before_values('x = f"Create a {name} as"\ny = f"an {other}"') == [1, 2]
    assert articles_before_values('x = f"{what} a day"\ny = f"data {name}"') == []


@pytest.mark.parametrize(("name", "expected"), [
    ("Adam", "an Adam"), ("AdamW", "an AdamW"), ("SGD", "an SGD"), ("LBFGS", "an LBFGS"),
    ("RMSprop", "an RMSprop"), ("NAdam", "an NAdam"), ("Adagrad", "an Adagrad"),
    ("ReduceLROnPlateau", "a ReduceLROnPlateau"), ("OneCycleLR", "a OneCycleLR"),
    ("DataLoader", "a DataLoader"), ("IterableDataset", "an IterableDataset"),
    ("DDP", "a DDP"), ("EMA", "an EMA"), ("int", "an int"), ("list", "a list"),
    ("generator", "a generator"), ("ndarray", "an ndarray"), ("UnitNorm", "a UnitNorm"),
    ("builtins.set", "a builtins.set"), ("hour", "an hour"), ("_Lookahead", "a _Lookahead"),
])
def test_with_article(name: str, expected: str) -> None:
    assert with_article(name) == expected


def test_the_optimizer_class_error_says_create_an_adam(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
    Loop(model, torch.optim.Adam(model.parameters()), data, loss_fn=F.mse_loss, device="cpu",
         callbacks=[Checkpoint(tmp_path)]).fit(1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
                device="cpu", callbacks=[Checkpoint(tmp_path, resume=True)])
    with pytest.raises(CheckpointError, match="Create an Adam as in the saved run"):
        loop.fit(2)
