"""Deprecated aliases: a public name that was renamed keeps working, with a warning, for
one minor version before it goes.

Callbacks published by others read hookloop's attributes; removing one without warning
breaks them at once (PITFALLS O.11). A renamed attribute becomes a `deprecated_alias` on
its class: reading it returns what the new name gives and warns with
`hookloop.errors.HookloopDeprecationWarning`, which names the new spelling and the
release that removes the old one. tests/test_public_api.py lists every public name, so a
removal is always a decision.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable
from typing import Any

from hookloop.errors import HookloopDeprecationWarning

__all__ = ["deprecated_alias", "CheckpointAliases", "REMOVED_IN", "MOVED_MODULES", "MovedModules",
           "install_moved_modules"]

#: The release that removes the aliases deprecated in this one (one minor version later).
REMOVED_IN = "0.3"


class deprecated_alias:  # noqa: N801 - used like @property
    """A read-only attribute that warns and reads its replacement.

    Args:
        replacement: How to write it now, for the message (``"Checkpoint.top_k[0]['epoch']"``).
        read: ``fn(instance) -> value``: what the old name gives.
        old: The old name as users write it; default ``Class.attribute`` (a NamedTuple's
            class body does not tell the alias its name: give it there).
        removed_in: The release that removes the alias.

    Example:
        >>> import warnings
        >>> class Run:
        ...     done = 3
        ...     finished = deprecated_alias("Run.done", lambda run: run.done)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     Run().finished
        3
        >>> print(caught[0].message)
        Run.finished is deprecated: use Run.done (Run.finished will be removed in hookloop 0.3).
    """

    def __init__(self, replacement: str, read: Callable[[Any], Any], *, old: str | None = None,
                 removed_in: str = REMOVED_IN) -> None:
        self.replacement, self.read, self.removed_in = replacement, read, removed_in
        self.old, self._named = old or "?", old is not None
        self.__doc__ = f"Deprecated: use {replacement} (removed in hookloop {removed_in})."

    def __set_name__(self, owner: type, name: str) -> None:
        if not self._named:
            self.old = f"{owner.__name__}.{name}"

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:  # read from the class (help(), dir(), the API listing)
            return self
        warnings.warn(f"{self.old} is deprecated: use {self.replacement} ({self.old} will be "
                      f"removed in hookloop {self.removed_in}).", HookloopDeprecationWarning,
                      stacklevel=2)
        return self.read(instance)


def _best(field: str) -> Callable[[Any], Any]:
    return lambda checkpoint: checkpoint.top_k[0][field] if checkpoint.top_k else None


class CheckpointAliases:
    """`Checkpoint`'s deprecated names, kept here beside their removal release so the
    callback's own module holds only what it does: the best file's epoch and step are now
    ``top_k[0]``'s."""

    best_epoch = deprecated_alias("Checkpoint.top_k[0]['epoch']", _best("epoch"),
                                  old="Checkpoint.best_epoch")
    best_step = deprecated_alias("Checkpoint.top_k[0]['step']", _best("step"),
                                 old="Checkpoint.best_step")


#: The modules the package's split into floors moved (issue 23), old path -> new one. The
#: old paths still import, as the same module object (so a monkeypatch through either
#: reaches the code), with a warning, until `REMOVED_IN`; each kept its name. Modules created
#: since are not here.
MOVED_MODULES = {f"hookloop.{new.rpartition('.')[2]}": f"hookloop.{new}" for new in (
    "base.deprecation", "base.versions", "base.compat", "base.events", "base.phase",
    "base.clock", "base.modules", "base.checks", "parallel.mesh", "parallel.slurm",
    "parallel.signals", "parallel.suspension", "parallel.blocks", "runfile.sharded",
    "runfile.integrity", "runfile.storage", "runfile.checkpoint_files", "runfile.shard_files",
    "runfile.background_save", "runfile.directory_lock", "runfile.ranking", "engine.untouched",
    "engine.dispatch", "engine.state", "engine.position", "engine.forward", "engine.stepper",
    "engine.boundary", "engine.cadence", "engine.ordering", "engine.sanity", "engine.data",
    "engine.geometry", "engine.resumable", "engine.samplers", "engine.grads", "engine.rng",
    "presets.registry")}
#: ``hookloop.run_state`` (0.1) moved to ``hookloop.engine.run_state``, whose code the run's
#: parts took over (issue 34): its old path imports the module of its fit-start check
#: (`check_callback_states`) and of the callbacks' and ``state=`` objects' parts.
MOVED_MODULES["hookloop.run_state"] = "hookloop.engine.stateful"


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old path (`MOVED_MODULES`) as its new module, warning
    `hookloop.errors.HookloopDeprecationWarning` with the new path.

    Example:
        >>> import sys, warnings
        >>> _ = sys.modules.pop("hookloop.mesh", None)  # as in a fresh process
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     from hookloop.mesh import Mesh
        >>> Mesh.__module__
        'hookloop.parallel.mesh'
        >>> print(caught[0].message)  # doctest: +ELLIPSIS
        hookloop.mesh is deprecated: import hookloop.parallel.mesh (hookloop.mesh will be removed in hookloop 0.3).
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: Any) -> Any:
        new = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} is deprecated: import {new} ({spec.name} will be removed "
                      f"in hookloop {REMOVED_IN}).", HookloopDeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system sets the old spec on it
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = module.__spec__.loader_state  # its own spec back


def install_moved_modules() -> None:
    """Let the old paths of `MOVED_MODULES` import (once per process)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
