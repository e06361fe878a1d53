"""Callbacks are leaves: no module of hookloop/callbacks/ imports another one.

What two callbacks share (a norm, a probe, a monitor) lives in the core; a callback that
imported another would make removing or replacing one change the other. Checked with
``ast`` over every module (its ``__init__`` aside, which gathers them), including imports
inside functions and ``TYPE_CHECKING`` blocks.
"""

from __future__ import annotations

import ast
from pathlib import Path

CALLBACKS = Path(__file__).resolve().parents[2] / "hookloop" / "callbacks"


def callback_imports(source: str) -> list[str]:
    """``line: code`` of every import of a ``hookloop.callbacks`` module in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            inside = node.level > 0 or module == "hookloop.callbacks" or module.startswith(
                "hookloop.callbacks.") or (module == "hookloop" and any(
                    alias.name == "callbacks" for alias in node.names))
        elif isinstance(node, ast.Import):
            inside = any(alias.name == "hookloop.callbacks"
                         or alias.name.startswith("hookloop.callbacks.") for alias in node.names)
        else:
            continue
        if inside:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_each_kind_of_import() -> None:
    source = """
from hookloop import callbacks
from hookloop.callbacks import AMP
from hookloop.callbacks.grad_clip import GradClip
from . import ema
from .metrics import Metrics
import hookloop.callbacks.tensorboard
def later():
    from hookloop.callbacks.probe import untouched
from hookloop import distributed
import hookloop.base.checks
from hookloop.engine.grads import total_norm
"""
    assert [entry.split(":")[0] for entry in callback_imports(source)] == [
        "2", "3", "4", "5", "6", "7", "9"]


def test_no_callback_module_imports_another() -> None:
    modules = sorted(path for path in CALLBACKS.glob("*.py") if path.name != "__init__.py")
    assert len(modules) >= 14  # every built-in callback module is scanned
    offenders = {path.name: uses for path in modules
                 if (uses := callback_imports(path.read_text(encoding="utf-8")))}
    assert offenders == {}, f"move what they share into the core: {offenders}"
