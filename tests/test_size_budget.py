"""The shape the redesign keeps: a loop read in one sitting, owners instead of flags.

Budgets are counted, not eyeballed, so that every later change has to respect them: a fix
that needs state goes into the object that owns the concern, not into `Loop`.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hookloop"
#: The budgets of the loop and of the checkpoint callback (tests/test_architecture.py keeps
#: slack under them).
LOOP_LOGIC_LINES = 300
TRAIN_EPOCH_LOGIC_LINES = 40
CHECKPOINT_LINES = 300
_LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
           tokenize.ENCODING, tokenize.ENDMARKER}


def logic_lines(source: str, first: int = 1, last: int | None = None) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _LAYOUT:
            lines.update(range(token.start[0], token.end[0] + 1))
    last = last if last is not None else len(source.splitlines())
    return len({line for line in lines - docstrings if first <= line <= last})


def function(source: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"no function {name}")


def test_the_counter_counts_code_only() -> None:
    source = '"""Doc."""\n\n# a comment\nx = (1,\n     2)  # trailing\n\ndef f():\n    """Doc."""\n    return x\n'
    assert logic_lines(source) == 4  # x = (1, / 2) / def f(): / return x


def test_loop_py_stays_within_300_logic_lines() -> None:
    source = (PACKAGE / "loop.py").read_text()
    assert logic_lines(source) <= LOOP_LOGIC_LINES


def test_train_epoch_stays_within_40_logic_lines() -> None:
    source = (PACKAGE / "loop.py").read_text()
    node = function(source, "_train_epoch")
    assert logic_lines(source, node.lineno, node.end_lineno) <= TRAIN_EPOCH_LOGIC_LINES


def test_checkpoint_py_stays_within_300_lines() -> None:
    lines = (PACKAGE / "callbacks" / "checkpoint.py").read_text().splitlines()
    assert len(lines) <= CHECKPOINT_LINES


def _reads_loop_private(node: ast.AST) -> bool:
    """``loop._x`` or ``self._loop._x``: a private attribute of something named a loop."""
    if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__")):
        return False
    value = node.value
    name = value.id if isinstance(value, ast.Name) else (
        value.attr if isinstance(value, ast.Attribute) else "")
    return name.lstrip("_") == "loop"


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if p.name != "loop.py"),
                         ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_module_but_loop_py_reads_a_private_attribute_of_the_loop(path: Path) -> None:
    tree = ast.parse(path.read_text())
    found = [f"line {node.lineno}: .{node.attr}" for node in ast.walk(tree)
             if _reads_loop_private(node)]
    assert not found, f"{path.name} reads private attributes of the loop: {found}"


def test_presets_define_no_callback_class() -> None:
    for path in (PACKAGE / "presets" / "__init__.py", PACKAGE / "presets" / "builtin.py"):
        tree = ast.parse(path.read_text())
        classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
        assert not [name for name in classes if not name.startswith("_")], (path.name, classes)
