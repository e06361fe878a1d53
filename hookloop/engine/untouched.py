"""`untouched`: run something outside training and leave everything as it was found.

The sanity check, ``validate``/``evaluate``/``predict``, a model summary's probing forward
pass, a TensorBoard graph trace and ``lr_find`` all run the model between (or before)
training steps. Each must leave the run exactly as an uninterrupted one: the random
streams (a DataLoader draws its base seed from torch's generator when it is iterated, and
dropout draws from it too), each submodule's train/eval mode (a frozen BatchNorm stays in
eval mode), and where asked the model's tensors (a BatchNorm's running statistics). This
is the one context they all use.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from hookloop.engine.rng import capture_rng, loader_generators, restore_rng

__all__ = ["untouched"]


@contextmanager
def untouched(model: nn.Module | None = None, generators: Iterable[torch.Generator] = (), *,
              data: Iterable[Any] = (), tensors: Literal[False, "buffers", "all"] = False
              ) -> Iterator[None]:
    """On exit, everything the block may change is put back as it was on entry.

    Always: torch's CPU and CUDA generators, Python's and NumPy's global generators,
    ``generators``, and the generators each loader in ``data`` draws its order from. With ``model``: each submodule's train/eval mode.
    With ``tensors="buffers"``: the model's buffers (BatchNorm statistics), non-persistent
    ones too; with ``tensors="all"``: its parameters as well. Also after an exception.

    Args:
        model: The module whose modes (and tensors) to keep, or None.
        generators: Extra ``torch.Generator`` objects to put back.
        data: Loaders (or any data) whose own generators to put back too.
        tensors: ``False``, ``"buffers"`` or ``"all"``: which of the model's tensors to keep.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> before = torch.get_rng_state()
        >>> with untouched(model, tensors="buffers"):
        ...     _ = model(torch.randn(4, 2))   # draws, and updates the running statistics
        ...     _ = model.eval()
        >>> torch.equal(torch.get_rng_state(), before), model.training
        (True, True)
        >>> float(model[1].running_mean.abs().sum())
        0.0
    """
    generators = [*generators, *(found for item in data for found in loader_generators(item))]
    saved_rng = capture_rng(generators, full=True)
    modes = [(module, module.training) for module in model.modules()] if model is not None else []
    kept: list[torch.Tensor] = []
    if model is not None and tensors:
        kept = list(model.buffers()) if tensors == "buffers" else [*model.parameters(),
                                                                   *model.buffers()]
    with torch.no_grad():
        saved_tensors = [tensor.detach().clone() for tensor in kept]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(kept, saved_tensors):
                tensor.copy_(value)
        for module, training in modes:
            module.training = training
        restore_rng(saved_rng, generators)
