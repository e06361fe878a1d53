"""The public API, listed: every name a user or a published callback may rely on, against
the checked-in list tests/public_api.txt (issue 25, item 14).

A name that disappears fails this test: a public name is removed or renamed only after a
deprecated alias (`hookloop.base.deprecation.deprecated_alias`) has warned for one minor
version, so a removal is always a decision. A name that appears fails it too, until it is
recorded, so that its later removal is seen. To record the API as the code has it now::

    python tests/test_public_api.py --update

and commit tests/public_api.txt with the change (after a merge: run it once on the merged
tree, and check that the lines it deletes are removals someone decided).

What is listed: every name in ``__all__`` of the public modules (`MODULES`); for each
class among them (and `EXTRA_CLASSES`, reached through a public attribute) its public
attributes and methods, the attributes its ``__init__`` sets on ``self``, and the
parameters of its constructor and methods; for each public function its parameters. What
a class inherits from a listed base or from Python (``Callback``'s events on every
callback, ``Exception``'s ``args``) is listed once, on the base.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

LISTING = Path(__file__).resolve().parent / "public_api.txt"
MODULES = ("hookloop", "hookloop.callbacks", "hookloop.errors", "hookloop.presets",
           "hookloop.schedules", "hookloop.distributed")
#: Public classes no ``__all__`` names, reached through a public attribute, under the name
#: they are listed by (the one they had before the package was split into floors, issue 23)
#: -> where they are defined.
EXTRA_CLASSES = {"hookloop.position.RunPosition": "hookloop.engine.position.RunPosition"}
HEADER = """\
# The public API of hookloop, one name a line (tests/test_public_api.py checks it).
# A line that disappears is a removal: deprecate first (hookloop.base.deprecation), for one
# minor version. Rewrite this file from the code: python tests/test_public_api.py --update
"""


def _parameters(function: Any) -> list[str]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    return [name for name in signature.parameters if name not in ("self", "cls")]


def _init_attributes(cls: type) -> set[str]:
    """Public names ``__init__`` assigns on ``self`` (read from its source, nothing run)."""
    found: set[str] = set()
    init = cls.__dict__.get("__init__")
    if init is None or not inspect.isfunction(init):
        return found
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return found
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            for item in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and \
                        item.value.id == "self" and not item.attr.startswith("_"):
                    found.add(item.attr)
    return found


def _owned(cls: type, classes: set[type]) -> set[str]:
    """The public names of ``cls`` not inherited from a listed class or from Python."""
    inherited: set[str] = set()
    for base in cls.__mro__[1:]:
        if base in classes or base.__module__ == "builtins" or base.__module__ in (
                "enum", "typing", "collections"):
            inherited.update(dir(base))
    names = {name for name in dir(cls) if not name.startswith("_")} - inherited
    if issubclass(cls, enum.Enum):
        names |= set(cls.__members__)
    for klass in cls.__mro__:
        if klass is object or klass in classes and klass is not cls:
            break
        if klass.__module__.startswith("hookloop"):
            names |= _init_attributes(klass)
    return names


def public_api() -> list[str]:
    """Every line of the listing, as the code has it now (sorted)."""
    lines: set[str] = set()
    classes: dict[type, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            path = f"{module_name}.{name}"
            lines.add(path)
            if inspect.isclass(value):
                classes.setdefault(value, path)
            elif callable(value):
                lines.update(f"{path}({parameter})" for parameter in _parameters(value))
    for path, defined in EXTRA_CLASSES.items():
        module_name, _, name = defined.rpartition(".")
        value = getattr(importlib.import_module(module_name), name)
        lines.add(path)
        classes.setdefault(value, path)
    known = set(classes)
    for cls, path in classes.items():
        if cls.__module__ == "builtins":
            continue
        init = cls.__dict__.get("__init__")
        if init is not None and inspect.isfunction(init):
            lines.update(f"{path}({parameter})" for parameter in _parameters(init))
        for name in _owned(cls, known):
            lines.add(f"{path}.{name}")
            member = inspect.getattr_static(cls, name, None)
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if inspect.isfunction(member):
                lines.update(f"{path}.{name}({parameter})" for parameter in _parameters(member))
    return sorted(lines)


def recorded() -> list[str]:
    return [line.strip() for line in LISTING.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_the_public_api_is_the_recorded_one() -> None:
    now, then = set(public_api()), set(recorded())
    gone, new = sorted(then - now), sorted(now - then)
    problems = []
    if gone:
        problems.append(
            "Public names that are gone (a removal or a rename): " + ", ".join(gone) + ". "
            "A public name is removed only after a deprecated alias has warned for one minor "
            "version: keep the old name as hookloop.base.deprecation.deprecated_alias(...). If the "
            "removal is decided, record it: python tests/test_public_api.py --update")
    if new:
        problems.append(
            "New public names, not in tests/public_api.txt yet: " + ", ".join(new) + ". "
            "Record them (so that removing one later is seen): "
            "python tests/test_public_api.py --update, and commit tests/public_api.txt")
    assert not problems, "\n\n".join(problems)


def test_the_listing_sees_what_it_must() -> None:
    """The listing is not empty where it matters: the names of issue 25, item 14, the
    parameters, the attributes set in __init__, and no private name."""
    now = set(public_api())
    for line in ("hookloop.Loop", "hookloop.Loop.fit(max_steps)", "hookloop.Loop.model",
                 "hookloop.Loop.position", "hookloop.position.RunPosition.batches_done",
                 "hookloop.position.RunPosition.batch_idx",
                 "hookloop.callbacks.Checkpoint.best_epoch",
                 "hookloop.callbacks.Checkpoint.best_step", "hookloop.callbacks.Checkpoint.top_k",
                 "hookloop.callbacks.Checkpoint(dirpath)", "hookloop.Callback.on_fit_start",
                 "hookloop.errors.HookloopDeprecationWarning", "hookloop.presets.standard(amp)",
                 "hookloop.Event.ON_FIT_START", "hookloop.LoopState.batch_idx"):
        assert line in now, line
    assert not [line for line in now if re.search(r"\._[^_]|\(_", line)]
    assert "hookloop.callbacks.EMA.on_fit_start" not in now  # listed once, on Callback


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/test_public_api.py --update  (rewrites tests/public_api.txt)")
    sys.path.insert(0, str(LISTING.parent.parent))  # this checkout's hookloop
    lines = public_api()
    LISTING.write_text(HEADER + "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} names to {LISTING}")
