"""presets.py holds presets only (issue 15): no Callback class of its own, and the names it
used to define still reachable from it."""

from __future__ import annotations

import ast
import inspect

from hookloop import Callback, presets
import hookloop.callbacks

from conftest import ROOT


def test_presets_defines_no_callback_class() -> None:
    for name in ("__init__.py", "builtin.py"):  # the presets and the built-in ones
        tree = ast.parse((ROOT / "hookloop" / "presets" / name).read_text(encoding="utf-8"))
        assert [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)] == []
    own = [name for name, value in vars(presets).items()
           if inspect.isclass(value) and issubclass(value, Callback)
           and value.__module__ == presets.__name__]
    assert own == []


def test_the_moved_names_are_re_exported() -> None:
    assert presets.DetectAnomaly is hookloop.callbacks.DetectAnomaly
    assert presets.ShortRun is hookloop.callbacks.ShortRun
    assert {"DetectAnomaly", "ShortRun"} <= set(hookloop.callbacks.__all__)
    assert {"ENTRY_POINT_GROUP", "DetectAnomaly", "ShortRun", "available", "get"} <= set(
        presets.__all__)
