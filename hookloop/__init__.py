"""hookloop: a PyTorch training loop that is a minimal event emitter.

Every feature (mixed precision, DDP, clipping, accumulation, EMA, schedules, metrics, early
stopping, checkpoints, logging) is an independent `Callback` stacked in a list.

The package's names are imported on first use (PEP 562), so that ``import hookloop`` and
the ``hookloop`` command do not import torch before they need it: a usage error of
``hookloop run`` comes at once, not after torch's import.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import types
import warnings
from typing import TYPE_CHECKING

from hookloop.base.deprecation import install_moved_modules
from hookloop.errors import (
    CallbackOrderError,
    CheckpointError,
    CheckpointWriteError,
    ConfigurationError,
    HookloopDeprecationWarning,
    HookloopError,
    LogWriteError,
    NonFiniteError,
    Suspended,
    Terminated,
)

if TYPE_CHECKING:
    from hookloop import distributed
    from hookloop.base.events import Event
    from hookloop.base.phase import Phase
    from hookloop.callback import Callback
    from hookloop.engine.describe import describe
    from hookloop.engine.state import LoopState
    from hookloop.export import export_safetensors
    from hookloop.loop import Loop
    from hookloop.lr_find import LRFindResult, lr_find
    from hookloop.parallel.mesh import Mesh
    from hookloop.runfile.loading import load_checkpoint

__version__ = "0.1.0"

install_moved_modules()  # the modules' paths before the floors (issue 23), until 0.3

# A renamed name warns once per place, also from a published callback's module (Python
# hides DeprecationWarnings outside __main__), unless -W or PYTHONWARNINGS say otherwise.
if not sys.warnoptions:
    warnings.filterwarnings("default", category=HookloopDeprecationWarning)

#: The names imported on first use -> their module (the module itself for ``distributed``).
_LAZY = {
    "Callback": "hookloop.callback",
    "Event": "hookloop.base.events",
    "LRFindResult": "hookloop.lr_find",
    "Loop": "hookloop.loop",
    "LoopState": "hookloop.engine.state",
    "Mesh": "hookloop.parallel.mesh",
    "Phase": "hookloop.base.phase",
    "describe": "hookloop.engine.describe",
    "distributed": "hookloop.distributed",
    "export_safetensors": "hookloop.export",
    "load_checkpoint": "hookloop.runfile.loading",
    "lr_find": "hookloop.lr_find",
}

if not TYPE_CHECKING:  # type checkers read the imports above; a typo stays an error there

    def __getattr__(name: str) -> object:
        if name not in _LAZY:
            # A module, as the eager __init__ of 0.1 left it imported: a subpackage with its
            # modules (hookloop.parallel.mesh.Mesh, as the 0.1 docs spelled it).
            if not name.startswith("_") and name in _SUBMODULES:
                module = importlib.import_module(f"hookloop.{name}")
                for found in pkgutil.iter_modules(getattr(module, "__path__", [])):
                    if not found.name.startswith("_"):
                        importlib.import_module(f"hookloop.{name}.{found.name}")
                return module
            raise AttributeError(f"module 'hookloop' has no attribute {name!r}")
        module = importlib.import_module(_LAZY[name])
        value = module if name == "distributed" else getattr(module, name)
        globals()[name] = value
        return value


#: The modules and subpackages directly under the package (no import: their file names).
_SUBMODULES = frozenset(
    entry.name.removesuffix(".py") for entry in os.scandir(os.path.dirname(__file__))
    if entry.name.endswith(".py") or os.path.isfile(os.path.join(entry.path, "__init__.py")))


def __dir__() -> list[str]:
    return sorted({*__all__, *_LAZY, *(name for name in globals() if name.startswith("__"))})


class _Package(types.ModuleType):
    """The package's module: ``hookloop.lr_find`` stays the function when its module of the
    same name is imported after it (the import system sets the module on its package)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "lr_find" and isinstance(value, types.ModuleType):
            value = value.lr_find
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "Callback",
    "CallbackOrderError",
    "CheckpointError",
    "CheckpointWriteError",
    "ConfigurationError",
    "Event",
    "HookloopDeprecationWarning",
    "HookloopError",
    "LRFindResult",
    "LogWriteError",
    "Loop",
    "LoopState",
    "Mesh",
    "NonFiniteError",
    "Phase",
    "Suspended",
    "Terminated",
    "__version__",
    "describe",
    "distributed",
    "export_safetensors",
    "load_checkpoint",
    "lr_find",
]
