"""`RunParts`: the loop's values the run's state is captured from and restored into.

`Loop` builds one at each `Loop.state_dict` and at each setup that applies a state, so
`hookloop.engine.run_state` and `hookloop.engine.run_restore` are handed values, never the loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from hookloop.callback import Callback
    from hookloop.engine.position import Position
    from hookloop.engine.run_end import RunEnd
    from hookloop.engine.state import LoopState

__all__ = ["RunParts"]


@dataclass(frozen=True)
class RunParts:
    """What the run's state is captured from and restored into: the loop's values, built by
    `Loop` at each call (none of these functions sees the loop)."""

    #: The model without its DDP/compile wrappers.
    model: nn.Module
    optimizer: torch.optim.Optimizer
    callbacks: Sequence[Callback]
    #: The objects of ``Loop(state=...)``, by name.
    extra_state: Mapping[str, Any]
    state: LoopState
    position: Position
    end: RunEnd
    #: ``len(train_data)``, or None.
    batches_per_epoch: int | None
    device: torch.device
    train_data: Any
    #: Inside ``fit`` (a pass alone leaves the state pending for the next fit).
    fitting: bool
