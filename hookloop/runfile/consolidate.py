"""The whole weights of a checkpoint, read in one process on the CPU without the model: from
a file, or from a directory of shards written by any number of ranks, with no process group
(`hookloop.export_safetensors` writes them for inference).

Reading goes through the checks every load makes (`hookloop.runfile.loading.read_checkpoint`):
a file's archive CRCs and layout; a directory's ``hookloop.pt``, the save id and the size and
digest of every file before DCP reads a byte, and DCP's ``.metadata`` unpickled admitting
only DCP's classes. The shapes and dtypes of the model's tensors come from that metadata,
so no model is built: DCP fills whole CPU tensors from every rank's shards.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from hookloop.errors import CheckpointError
from hookloop.runfile import integrity
from hookloop.runfile.format import CALLBACKS, MODEL, SHARDS
from hookloop.runfile.loading import read_checkpoint

__all__ = ["EMA_SHADOW", "Weights", "read_weights"]

#: The entry of the `hookloop.callbacks.EMA` callback's state that holds its averaged weights.
EMA_SHADOW = "shadow"


class Weights:
    """What `read_weights` found: ``tensors`` (names to whole CPU tensors, in the saved
    order), ``source`` (``"model"`` or the EMA's state key) and ``skipped`` (entries that are
    not tensors, such as a module's ``_extra_state``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str, skipped: list[str]
                 ) -> None:
        self.tensors, self.source, self.skipped = tensors, source, skipped


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """Without DCP's warning that it reads in one process, which is what is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _directory_model(path: str, shards: Any) -> dict[str, Any]:
    """The model's entries of the sharded checkpoint ``path``, whole, as DCP's metadata
    describes them (each rank's shards put together)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{MODEL}."
    entries = integrity.read_metadata(path).state_dict_metadata
    targets: dict[str, Any] = {}
    for key, entry in entries.items():
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata):
            targets[key[len(prefix):]] = torch.empty(entry.size, dtype=entry.properties.dtype)
    others = [key[len(prefix):] for key in entries
              if key.startswith(prefix) and key[len(prefix):] not in targets]
    if targets:
        with _one_process():  # no process group: this process reads every rank's shards
            shards.read_into({MODEL: targets})
    return {**targets, **{name: None for name in others}}


def _ema_state(path: str, payload: Mapping[str, Any], ema: bool | str) -> tuple[str, Any]:
    """``(state key, shadow)`` of the EMA ``ema`` names (True: the only one)."""
    states = payload.get(CALLBACKS) or {}
    found = [str(key) for key, state in states.items()
             if isinstance(state, Mapping) and isinstance(state.get(EMA_SHADOW), Mapping)]
    if not found:
        hint = (" It is a best file: it holds the validated weights (the EMA's, when the EMA "
                "validated with them), not the callbacks' states; export it without ema."
                if CALLBACKS not in payload else " Was an EMA callback in the run's stack?")
        raise CheckpointError(f"{path}: holds no EMA weights (no callback state has the "
                              f"entry {EMA_SHADOW!r}).{hint}")
    if ema is True:
        if len(found) > 1:
            raise CheckpointError(
                f"{path}: holds the weights of {len(found)} EMAs ({', '.join(found)}); name "
                f"the one to export: ema={found[0]!r}.")
        key = found[0]
    elif ema not in found:
        raise CheckpointError(f"{path}: holds no EMA state under {ema!r}; its EMA states: "
                              f"{', '.join(found)}.")
    else:
        key = str(ema)
    shadow = states[key][EMA_SHADOW]
    if not shadow:
        raise CheckpointError(f"{path}: the EMA {key!r} had no averaged weights yet when this "
                              "checkpoint was saved (saved before its first fit).")
    return key, shadow


def read_weights(path: str | os.PathLike[str], *, ema: bool | str = False) -> Weights:
    """The whole weights of the checkpoint ``path`` on the CPU: the model's, or an EMA's.

    Args:
        path: A checkpoint file (rotating or best) or a directory of shards (``.dcp``).
        ema: False: the model's weights; True: the averaged weights of the run's
            `hookloop.callbacks.EMA` (its shadow in the callbacks' states); a string: the
            EMA with that state key (its ``name``), for a run with several.

    Raises:
        CheckpointError: the checkpoint is missing, damaged, not hookloop's, or holds no
            such EMA (a best file keeps no callback states).
    """
    path = os.fspath(path)
    payload = read_checkpoint(path, "cpu")
    shards = payload.get(SHARDS)
    if ema is False:
        source = MODEL
        entries = _directory_model(path, shards) if shards is not None else payload[MODEL]
    else:
        source, entries = _ema_state(path, payload, ema)
        if shards is not None:
            with _one_process():  # the marked DTensors, read whole from the shards
                entries = shards.resolve(entries)
    tensors = {str(name): value for name, value in entries.items()
               if isinstance(value, torch.Tensor)}
    skipped = [str(name) for name in entries if str(name) not in tensors]
    if skipped:
        warnings.warn(f"{path}: {len(skipped)} entries of the {source} weights are not tensors "
                      f"and are not exported: {', '.join(skipped[:5])}.", RuntimeWarning,
                      stacklevel=2)
    if not tensors:
        raise CheckpointError(f"{path}: the {source} weights hold no tensor to export.")
    return Weights(tensors, source, skipped)
