"""Reading a checkpoint, a file or a directory of shards, for users: `load_checkpoint` (with
`hookloop.runfile.checkpoint_files.read_checkpoint`, the `Checkpoint` callback's reader)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from hookloop import distributed
from hookloop.base.modules import unwrap
from hookloop.runfile.checkpoint_files import read_checkpoint
from hookloop.runfile.remote_store import fetched, is_url
from hookloop.runfile.weights import check_loadable, load_weights

__all__ = ["load_checkpoint", "read_checkpoint"]


def _default_location(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")



def load_checkpoint(path: str | os.PathLike[str], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *,
                    map_location: Any = None, strict: bool = True,
                    storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load the weights of a hookloop checkpoint into ``model`` (inference, fine-tuning).

    Reads rotating checkpoints and ``best.pt`` alike, with ``torch.load(weights_only=True)``
    (never an unsafe fallback). Tensors go to ``map_location``, by default the device the
    model is on, never the device recorded in the file.

    Args:
        path: The checkpoint file, or a sharded checkpoint directory (``.dcp``), or a save
            of a `Checkpoint` URL (``s3://bucket/run/best.pt``).
            Under a process group, a directory of shards is read by every rank together
            (call it on every rank, as DCP's load asks); each of its files is hashed by
            one rank.
        model: The module to load into (unwrapped from DDP and compile wrappers), sharded
            by FSDP or not: a file written by ``FSDP(state_dict="full")`` loads into an
            unsharded model for inference, and a directory of shards into either.
        optimizer: Also restore this optimizer (rotating checkpoints only).
        map_location: Where to put the loaded tensors; default: the model's device.
        strict: False loads into a changed model (fine-tuning with another head): the
            tensors whose names and shapes match are loaded, the others keep their values,
            and a ``RuntimeWarning`` names them. A file into an unsharded model only.
        storage_options: For a URL: the fsspec filesystem's options (as `Checkpoint`'s).

    Returns:
        The checkpoint's contents (``metrics``, ``loop`` counters, ``callbacks`` states...).

    Raises:
        CheckpointError: the file is missing, empty, truncated, damaged (a CRC-32 fails),
            not a hookloop checkpoint, or does not fit the model (wrong architecture) or
            the optimizer; a directory's file is missing, added, truncated, flipped or of
            another save (its save id and content digests), or its ``.metadata`` holds
            more than DCP's metadata classes (`hookloop.runfile.integrity`).

    Example:
        >>> import os, tempfile, torch
        >>> import hookloop
        >>> from hookloop import Loop
        >>> from hookloop.callbacks import Checkpoint
        >>> directory = tempfile.mkdtemp()
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1))]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[Checkpoint(directory)])
        >>> _ = loop.fit(1)
        hookloop: training ended at epoch 1/1, step 1: its 1 epoch is done.
        >>> fresh = torch.nn.Linear(3, 1)
        >>> contents = hookloop.load_checkpoint(os.path.join(directory, "epoch=0000-step=00000001.pt"), fresh)
        >>> torch.equal(fresh.weight, model.weight)
        True
    """
    if is_url(path):  # verified against its manifest, then read as a local file
        with fetched(str(path), storage_options) as local:
            return load_checkpoint(local, model, optimizer, map_location=map_location,
                                   strict=strict)
    model = unwrap(model)
    path = os.fspath(path)
    location = _default_location(model) if map_location is None else map_location
    # Under a process group, reading a directory of shards is a collective already (DCP's
    # load runs on every rank), so its files are hashed once, split among the ranks, as a
    # resume does, not once per rank.
    payload = read_checkpoint(path, location, every_rank=distributed.world_size() > 1)
    check_loadable(path, model, optimizer, payload, strict=strict)
    load_weights(path, model, optimizer, payload, strict=strict)
    return payload
