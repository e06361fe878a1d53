"""`export_safetensors`: a checkpoint's weights for inference, as safetensors files in the
Hugging Face layout (``hookloop export CHECKPOINT OUT_DIR`` on the command line).

The layout is the one ``transformers``' ``save_pretrained`` writes and ``from_pretrained``,
``safetensors.torch.load_file`` and inference servers read: ``model.safetensors``; past
``max_shard_size``, ``model-00001-of-0000n.safetensors`` ... with
``model.safetensors.index.json`` (``metadata.total_size``, the bytes of every tensor, and
``weight_map``, each tensor's name to its file). Tensors fill a file in the checkpoint's
order until the next would pass the size; a tensor larger than the size gets a file of its
own (``huggingface_hub``'s rule). safetensors refuses tensors that share memory: names that
share one tensor (tied weights) are written once, under the first name in the saved order,
and each file's metadata maps the other names to it (what ``safetensors.torch.save_model``
records); views that overlap other tensors are written as copies.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any

import torch

from hookloop.errors import CheckpointError, ConfigurationError
from hookloop.runfile.consolidate import read_weights
from hookloop.runfile.shard_files import is_complete

__all__ = ["INDEX_FILE", "export_safetensors", "parse_size"]

#: The index of a sharded export (the name ``transformers`` reads).
INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
#: Hugging Face's default ``max_shard_size``.
DEFAULT_SHARD_SIZE = "5GB"
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def parse_size(size: int | str, label: str = "max_shard_size") -> int:
    """Bytes from an int or from text as Hugging Face writes sizes: ``"5GB"`` (10^9),
    ``"500MB"``, ``"2GiB"`` (2^30).

    Example:
        >>> parse_size("5GB"), parse_size("1KiB"), parse_size(300)
        (5000000000, 1024, 300)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size > 0:
            return size
    elif isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", size)
        if match and match.group(2).lower() in _UNITS:
            found = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if found > 0:
                return found
    raise ConfigurationError(
        f"{label} must be a number of bytes > 0 or a size such as '5GB', '500MB' or "
        f"'2GiB', got {size!r}.")


def _local(path: str | os.PathLike[str], label: str) -> str:
    """``path`` as a local path; a URL is refused (remote storage is not read yet)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigurationError(f"export_safetensors {label} must be a path, got {path!r}.")
    text = os.fspath(path)
    if _URL.match(text):
        raise ConfigurationError(
            f"export_safetensors {label} {text!r} is a URL; only local paths are read and "
            "written for now (remote storage through fsspec comes later). Copy the "
            "checkpoint to a local disk first, e.g. with the store's own command line.")
    return text


def _check_checkpoint(path: str) -> None:
    """A directory of checkpoints, instead of one, named as such."""
    if not os.path.isdir(path) or is_complete(path):
        return
    names = sorted(name for name in os.listdir(path)
                   if name.endswith((".pt", ".dcp")) and not name.startswith("."))
    if names:
        listed = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
        raise CheckpointError(
            f"{path}: a directory of checkpoints ({listed}), not one checkpoint; export one "
            f"of them, e.g. {os.path.join(path, names[-1])}.")


def _check_out_dir(path: str) -> None:
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigurationError(f"export_safetensors out_dir {path!r} is a file; give a "
                                 "directory (new or empty).")
    if os.path.isdir(path) and os.listdir(path):
        found = ", ".join(sorted(os.listdir(path))[:4])
        raise ConfigurationError(
            f"export_safetensors out_dir {path!r} is not empty ({found}); an export there "
            "could mix its files with an earlier one's (another number of shards, a stale "
            "index). Give a new or empty directory, or delete that one first.")


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    if tensor.numel() == 0:
        return ("empty", id(tensor))
    return (tensor.device, tensor.untyped_storage().data_ptr())


def _same_view(first: torch.Tensor, second: torch.Tensor) -> bool:
    return (first.dtype == second.dtype and first.shape == second.shape
            and first.stride() == second.stride()
            and first.storage_offset() == second.storage_offset())


def without_aliases(tensors: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, aliases)``: every tensor once, in its own contiguous memory, as
    safetensors needs; ``aliases`` maps each dropped name to the name kept for it.

    Example:
        >>> weight = torch.ones(2, 2)
        >>> kept, aliases = without_aliases({"embed": weight, "head": weight})
        >>> list(kept), aliases
        (['embed'], {'head': 'embed'})
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(_storage_key(tensor), []).append(name)
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, tensor in tensors.items():
        group = groups[_storage_key(tensor)]
        if len(group) == 1:
            kept[name] = tensor.contiguous()
            continue
        first = next(other for other in group if _same_view(tensors[other], tensor))
        if first != name:
            aliases[name] = first
        else:  # shares memory with other views: a copy of its own
            kept[name] = tensor.clone(memory_format=torch.contiguous_format)
    return kept, aliases


def shard_names(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The names of each file, in order: a file takes tensors until the next would pass
    ``max_bytes``; a tensor larger than that gets a file of its own.

    Example:
        >>> tensors = {"a": torch.ones(3), "b": torch.ones(3), "c": torch.ones(10)}
        >>> shard_names(tensors, 24)   # 12, 12 and 40 bytes: c at once, as huggingface_hub does
        [['c'], ['a', 'b']]
    """
    files: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_bytes:
            files.append([name])
            continue
        if current and size + nbytes > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        files.append(current)
    return files


def _write(directory: str, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
           max_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    groups = shard_names(tensors, max_bytes)
    count = len(groups)
    names = ([_SINGLE_FILE] if count == 1 else
             [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)])
    weight_map: dict[str, str] = {}
    for file, group in zip(names, groups):
        members = set(group)
        # safetensors' own header field (what torch's writers put there), then the aliases.
        metadata = dict(format="pt")
        metadata.update((alias, kept) for alias, kept in aliases.items() if kept in members)
        save_file({name: tensors[name] for name in group}, os.path.join(directory, file),
                  metadata=metadata)
        weight_map.update((name, file) for name in group)
    if count > 1:
        total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as handle:
            handle.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(INDEX_FILE)
    return names


def _import_safetensors() -> None:
    try:
        import safetensors.torch  # noqa: F401 - only asked whether it is there
    except ImportError as error:
        raise ConfigurationError(
            f"export_safetensors needs safetensors, which is not installed ({error}): "
            "pip install 'hookloop[safetensors]'.") from None


def export_safetensors(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                       ema: bool | str = False,
                       max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> list[str]:
    """Write a checkpoint's weights as safetensors in the Hugging Face layout, for inference.

    Reads the checkpoint in this process, on the CPU, with every check a load makes (CRCs,
    the save id and content digests of a directory's files); a directory of shards written
    by N ranks needs no process group and no model (DCP's metadata gives every tensor's
    shape and dtype). The files are written into a temporary directory beside ``out_dir``
    that is renamed to it when complete: an interrupted export leaves no half layout.

    Args:
        checkpoint: A checkpoint file (``epoch=...pt``, ``best.pt``) or a directory of
            shards (``.dcp``), on a local disk (a URL is refused for now).
        out_dir: The directory to write; it must be new or empty (an earlier export's files
            there could be mixed with this one's).
        ema: False: the model's weights. True: the averaged weights of the run's
            `hookloop.callbacks.EMA` (a rotating checkpoint holds them); a string: the EMA
            with that ``name``, in a run with several.
        max_shard_size: Past this many bytes the weights are split into several files and
            an index (an int, or ``"5GB"``, ``"500MB"``, ``"2GiB"``); Hugging Face's default.

    Returns:
        The names of the files written in ``out_dir`` (the index last).

    Raises:
        ConfigurationError: a URL, an ``out_dir`` that is a file or not empty, a bad
            ``max_shard_size``, or safetensors not installed
            (``pip install 'hookloop[safetensors]'``).
        CheckpointError: the checkpoint is missing, damaged, not hookloop's, a directory of
            checkpoints rather than one, or holds no such EMA.

    Example:
        >>> import os, tempfile, torch
        >>> from hookloop import Loop, export_safetensors
        >>> from hookloop.callbacks import Checkpoint
        >>> from safetensors.torch import load_file
        >>> directory = tempfile.mkdtemp()
        >>> model = torch.nn.Linear(3, 1)
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...             [(torch.randn(4, 3), torch.randn(4, 1))],
        ...             loss_fn=torch.nn.functional.mse_loss, callbacks=[Checkpoint(directory)])
        >>> _ = loop.fit(1)
        hookloop: training ended at epoch 1/1, step 1: its 1 epoch is done.
        >>> out = os.path.join(tempfile.mkdtemp(), "exported")
        >>> export_safetensors(os.path.join(directory, "epoch=0000-step=00000001.pt"), out)
        ['model.safetensors']
        >>> torch.equal(load_file(os.path.join(out, "model.safetensors"))["weight"], model.weight)
        True
    """
    source, target = _local(checkpoint, "checkpoint"), _local(out_dir, "out_dir")
    max_bytes = parse_size(max_shard_size)
    if not isinstance(ema, (bool, str)) or ema == "":
        raise ConfigurationError(f"export_safetensors ema must be True, False or an EMA's "
                                 f"name, got {ema!r}.")
    _check_out_dir(target)
    _import_safetensors()
    _check_checkpoint(source)
    tensors, aliases = without_aliases(read_weights(source, ema=ema).tensors)
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    temporary = os.path.join(parent, f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex}")
    os.mkdir(temporary)
    try:
        names = _write(temporary, tensors, aliases, max_bytes)
        if os.path.isdir(target):
            os.rmdir(target)  # empty (checked): the complete export takes its place
        os.replace(temporary, target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return names
