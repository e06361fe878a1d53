"""hookloop: a PyTorch training loop that is a minimal event emitter.

Every feature (mixed precision, DDP, clipping, accumulation, EMA, schedules, metrics, early
stopping, checkpoints, logging) is an independent `Callback` stacked in a list.
"""

from __future__ import annotations

import sys
import warnings

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.engine.describe import describe
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
from hookloop.base.deprecation import install_moved_modules
from hookloop.base.events import Event
from hookloop.base.phase import Phase
from hookloop.engine.state import LoopState
from hookloop.loop import Loop
from hookloop.lr_find import LRFindResult, lr_find
from hookloop.runfile.loading import load_checkpoint

__version__ = "0.1.0"

install_moved_modules()  # the modules' paths before the floors (issue 23), until 0.3

# A renamed name warns once per place, also from a published callback's module (Python
# hides DeprecationWarnings outside __main__), unless -W or PYTHONWARNINGS say otherwise.
if not sys.warnoptions:
    warnings.filterwarnings("default", category=HookloopDeprecationWarning)

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
    "NonFiniteError",
    "Phase",
    "Suspended",
    "Terminated",
    "__version__",
    "describe",
    "distributed",
    "load_checkpoint",
    "lr_find",
]
