"""The run file: its format (every key, its type, its version), writing it, checking it and
reading it back.

A checkpoint is one ``.pt`` file (``torch.save`` of a dict) or a directory of shards whose
``hookloop.pt`` holds the same dict less the sharded tensors (`hookloop.runfile.shard_files`). The
dict, as `Loop.state_dict` and `Checkpoint` write it::

    hookloop      the file's record of itself: format, kind ("resume"/"best"), version,
                  world_size, epoch, step; a best file's monitor and value; a directory's
                  save_id and files ({name: {bytes, sha256}}, `hookloop.runfile.integrity`)
    model         the weights: names to tensors
    optimizer     torch's optimizer state: state, param_groups (each with its params)
    loop          the position and the run: epoch, batch_idx, step, validated,
                  epoch_samples, world_size, batches_per_epoch, optimizer_class,
                  param_groups, epochs, max_steps, ended {reason, epochs, max_steps},
                  stop_held, history (rows of metrics with epoch and step)
    ranks         each rank's own part: train_loss_sum, train_samples, rng, epoch_rng,
                  prefetch_rng, mark_batches, mark_rng, workers_rng, data_state; a
                  generators' state (`hookloop.engine.rng`) holds torch, generators, cuda,
                  python, numpy
    callbacks     each stateful callback's state by its state key (the Checkpoint's
                  ranking: entries of value, epoch, step, file)
    state         the objects of ``Loop(state=...)`` by name; state_classes their classes
    metrics       the metrics at the save; epoch and step (a best file's, at the top)

Every key string of that format is a constant here, and only here (`KEYS`); the other
modules name the keys through these constants. `FORMAT` is the layout's version.
"""

from __future__ import annotations

import os
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hookloop import distributed
from hookloop.base.os_errors import describe_os_error
from hookloop.errors import CheckpointError, with_article
from hookloop.runfile.storage import verify_archive

__all__ = ["FORMAT", "KEYS", "SHARED_WORDS", "SHARDS", "check_payload", "check_run_fields",
           "find_unplain",
           "expect_field", "file_meta", "resume_payload", "best_payload", "run_payload",
           "ended_record", "read_payload", "rng_state_problem"]

#: Version of the file layout written by `Checkpoint` (1 is read too).
FORMAT = 2

# The top level.
META, MODEL, OPTIMIZER, LOOP, RANKS = "hookloop", "model", "optimizer", "loop", "ranks"
CALLBACKS, STATE, STATE_CLASSES, METRICS = "callbacks", "state", "state_classes", "metrics"
EPOCH, STEP = "epoch", "step"
#: The key under which a payload read from a sharded directory carries the object that
#: reads its tensors (`hookloop.runfile.shard_files.Shards`); never written to a file.
SHARDS = "shards"
# ``hookloop``: the file's record of itself.
FORMAT_FIELD, KIND, VERSION, WORLD_SIZE = "format", "kind", "version", "world_size"
MONITOR, VALUE, SAVE_ID, FILES = "monitor", "value", "save_id", "files"
BYTES, SHA256 = "bytes", "sha256"  # of each entry of FILES
RESUME, BEST = "resume", "best"  # the kinds
# ``optimizer`` (torch's layout) and its groups.
PARAM_GROUPS, PARAMS = "param_groups", "params"
# ``loop``.
BATCH_IDX, VALIDATED, EPOCH_SAMPLES = "batch_idx", "validated", "epoch_samples"
# The position in samples: the global batch it was counted in, the sampler's order (seed,
# shuffle, size, drop_last) and the steps taken before the epoch's pass began on its ranks.
GLOBAL_BATCH, EPOCH_ORDER, STEP_OFFSET = "global_batch", "epoch_order", "step_offset"
BATCHES_PER_EPOCH, OPTIMIZER_CLASS = "batches_per_epoch", "optimizer_class"
EPOCHS, MAX_STEPS, ENDED = "epochs", "max_steps", "ended"
STOP_HELD, HISTORY = "stop_held", "history"
REASON = "reason"  # of ``ended``
# Each part of ``ranks``.
TRAIN_LOSS_SUM, TRAIN_SAMPLES, DATA_STATE = "train_loss_sum", "train_samples", "data_state"
RNG, EPOCH_RNG, PREFETCH_RNG, MARK_RNG = "rng", "epoch_rng", "prefetch_rng", "mark_rng"
MARK_BATCHES, WORKERS_RNG = "mark_batches", "workers_rng"
#: Batches the training DataLoader's sampler had drawn past the position (its prefetch).
DRAWN_AHEAD = "drawn_ahead"
# A generators' state (`hookloop.engine.rng.capture_rng`).
RNG_TORCH, RNG_GENERATORS, RNG_CUDA = "torch", "generators", "cuda"
RNG_PYTHON, RNG_NUMPY = "python", "numpy"
# A ranking entry of `Checkpoint`'s state (`hookloop.runfile.ranking.TopK`): VALUE, EPOCH, STEP and
FILE = "file"
#: In ``hookloop.pt`` of a directory, what stands for a tensor kept in the shards.
SHARD_MARK = "__hookloop_shard__"

#: Every key string of the format: the constants above (the kinds are values, not keys).
KEYS = (META, MODEL, OPTIMIZER, LOOP, RANKS, CALLBACKS, STATE, STATE_CLASSES, METRICS, EPOCH,
        STEP, SHARDS, FORMAT_FIELD, KIND, VERSION, WORLD_SIZE, MONITOR, VALUE, SAVE_ID, FILES,
        BYTES, SHA256, PARAM_GROUPS, PARAMS, BATCH_IDX, VALIDATED, EPOCH_SAMPLES,
        GLOBAL_BATCH, EPOCH_ORDER, STEP_OFFSET,
        BATCHES_PER_EPOCH, OPTIMIZER_CLASS, EPOCHS, MAX_STEPS, ENDED, STOP_HELD, HISTORY, REASON,
        TRAIN_LOSS_SUM, TRAIN_SAMPLES, DATA_STATE, RNG, EPOCH_RNG, PREFETCH_RNG, MARK_RNG,
        MARK_BATCHES, WORKERS_RNG, DRAWN_AHEAD, RNG_TORCH, RNG_GENERATORS, RNG_CUDA, RNG_PYTHON,
        RNG_NUMPY, FILE, SHARD_MARK)
#: The keys that are also ordinary words with another meaning outside the run file (a
#: device type, a module's name, a log column, a message's word): a module that uses one
#: of them for that other meaning does not name the format.
SHARED_WORDS = frozenset((META, MODEL, OPTIMIZER, STATE, EPOCH, STEP, EPOCHS, MAX_STEPS,
                          HISTORY, METRICS, KIND, VERSION, WORLD_SIZE, VALUE,
                          BATCH_IDX, PARAM_GROUPS, PARAMS, CALLBACKS, RNG_TORCH, RNG_CUDA,
                          RNG_PYTHON, RNG_NUMPY, RNG_GENERATORS, FILE, BYTES))


# --------------------------------------------------------------------------- writing
def file_meta(kind: str) -> dict[str, Any]:
    """The ``hookloop`` entry of a file: version, `FORMAT`, ``kind`` and the world size.

    Example:
        >>> sorted(file_meta("best"))
        ['format', 'kind', 'version', 'world_size']
    """
    package = sys.modules.get(META)  # imported by now: this module is below it
    return {VERSION: getattr(package, "__version__", None), FORMAT_FIELD: FORMAT, KIND: kind,
            WORLD_SIZE: distributed.world_size()}


def resume_payload(run: Mapping[str, Any], epoch: int, step: int,
                   metrics: Mapping[str, float]) -> dict[str, Any]:
    """A rotating file's payload: ``run`` (`Loop.state_dict`) with its record and metrics."""
    return {META: {**file_meta(RESUME), EPOCH: epoch, STEP: step}, **run,
            METRICS: dict(metrics)}


def best_payload(weights: Mapping[str, Any], monitor: str | None, value: float, epoch: int,
                 step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
    """A best file's payload: validated ``weights`` scoring ``value`` for ``monitor``."""
    return {META: {**file_meta(BEST), MONITOR: monitor, VALUE: value}, MODEL: weights,
            EPOCH: epoch, STEP: step, METRICS: dict(metrics)}


def ended_record(reason: str, epochs: int, max_steps: int | None) -> dict[str, Any]:
    """``loop.ended``: why the run ended, under which ``epochs`` and ``max_steps``."""
    return {REASON: reason, EPOCHS: epochs, MAX_STEPS: max_steps}


def run_payload(*, model: Mapping[str, Any], optimizer: Mapping[str, Any],
                position: Mapping[str, Any], ranks: list[Any], world_size: int,
                batches_per_epoch: int | None, optimizer_object: torch.optim.Optimizer,
                epochs: int, max_steps: int | None, ended: Mapping[str, Any] | None,
                held: str | None, history: Sequence[Mapping[str, Any]],
                callbacks: Mapping[str, Any], extra: Mapping[str, Any],
                extra_classes: Mapping[str, str]) -> dict[str, Any]:
    """`Loop.state_dict`'s layout: ``position`` is what every rank shares of
    `hookloop.engine.position.Position.parts`, ``ranks`` each rank's own part."""
    return {
        MODEL: model,
        OPTIMIZER: optimizer,
        LOOP: {
            **position,
            WORLD_SIZE: world_size,
            BATCHES_PER_EPOCH: batches_per_epoch,
            OPTIMIZER_CLASS: type(optimizer_object).__qualname__,
            PARAM_GROUPS: [len(group[PARAMS]) for group in optimizer_object.param_groups],
            EPOCHS: epochs,
            MAX_STEPS: max_steps,
            ENDED: ended,
            STOP_HELD: held,  # a stop waiting for min_epochs/min_steps (`RunEnd.held`)
            HISTORY: [dict(row) for row in history],
        },
        RANKS: ranks,
        CALLBACKS: dict(callbacks),
        STATE: dict(extra),
        STATE_CLASSES: dict(extra_classes),
    }


# -------------------------------------------------------------------------- checking
_PRIMITIVES = (int, float, bool, str, bytes, complex, type(None))
_LEAVES = (torch.dtype, torch.device, torch.Size)


def find_unplain(value: Any, where: str) -> str | None:
    """Where ``value`` holds something ``torch.load(weights_only=True)`` would refuse."""
    if type(value) in _PRIMITIVES or isinstance(value, (torch.Tensor, *_LEAVES)):
        return None
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in _PRIMITIVES:
                return f"{where} has a key of type {type(key).__name__}"
            found = find_unplain(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if type(value) in (list, tuple, set, frozenset):
        for index, item in enumerate(value):
            found = find_unplain(item, f"{where}[{index}]")
            if found:
                return found
        return None
    return f"{where} is {with_article(f'{type(value).__module__}.{type(value).__qualname__}')}"


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, torch.Tensor) else f"of shape {tuple(value.shape)}"
    return f"({text[:60]}{'...' if len(text) > 60 else ''})"


def expect_field(path: str, field: str, value: Any, ok: bool, expected: str) -> None:
    """Raise `CheckpointError` naming ``path`` and ``field`` unless ``ok``: the one message
    form for a field of the wrong type in a checkpoint file.

    Example:
        >>> expect_field("x.pt", "loop.step", "3", False, "an int >= 0")
        Traceback (most recent call last):
        ...
        hookloop.errors.CheckpointError: x.pt: the checkpoint's field 'loop.step' is str ('3'), expected an int >= 0. The file was not written by this version of hookloop or was edited; resume from another file.
    """
    if not ok:
        raise CheckpointError(
            f"{path}: the checkpoint's field {field!r} is {_type_name(value)} "
            f"{_short(value)}, expected {expected}. The file was not written by this version "
            "of hookloop or was edited; resume from another file.")


def _expect_int(path: str, where: str, value: Any, minimum: int = 0, *,
                optional: bool = False) -> None:
    if optional and value is None:
        return
    expect_field(path, where, value, _is_int(value) and value >= minimum,
                 f"an int >= {minimum}" + (" or None" if optional else ""))


def _require(path: str, holder: Mapping[str, Any], where: str, field: str) -> Any:
    if field not in holder:
        raise CheckpointError(f"{path}: the checkpoint's field '{where}.{field}' is missing; "
                              "it cannot be resumed.")
    return holder[field]


def _check_meta(path: str, payload: Mapping[str, Any]) -> str:
    """``hookloop`` (and the top-level epoch and step); returns the file's kind."""
    meta = payload[META]
    version = meta.get(FORMAT_FIELD)
    expect_field(path, f"{META}.{FORMAT_FIELD}", version, _is_int(version), "an int")
    if version > FORMAT:
        raise CheckpointError(
            f"{path}: written by a newer hookloop (format {version}; this one reads up to "
            f"{FORMAT}); upgrade hookloop to read it.")
    if version < 1:
        raise CheckpointError(
            f"{path}: unknown checkpoint format {version} (valid: 1 to {FORMAT}).")
    kind = meta.get(KIND)
    expect_field(path, f"{META}.{KIND}", kind, kind in (RESUME, BEST), f"{RESUME!r} or {BEST!r}")
    for where, holder, field in ((f"{META}.{EPOCH}", meta, EPOCH), (f"{META}.{STEP}", meta, STEP),
                                 (EPOCH, payload, EPOCH), (STEP, payload, STEP)):
        if holder.get(field) is not None:
            _expect_int(path, where, holder[field])
    if meta.get(WORLD_SIZE) is not None:
        _expect_int(path, f"{META}.{WORLD_SIZE}", meta[WORLD_SIZE], 1)
    for field in (MONITOR, VERSION):
        if meta.get(field) is not None:
            expect_field(path, f"{META}.{field}", meta[field], isinstance(meta[field], str),
                         "a str or None")
    if meta.get(VALUE) is not None:
        expect_field(path, f"{META}.{VALUE}", meta[VALUE], _is_number(meta[VALUE]),
                     "a number or None")
    return kind


def _check_parts(path: str, payload: Mapping[str, Any]) -> None:
    """``model`` (names to tensors), ``callbacks``, ``metrics`` and ``ranks``."""
    model: Any = payload.get(MODEL)
    expect_field(path, MODEL, model, isinstance(model, Mapping), "a mapping of weights")
    for name, value in model.items():
        expect_field(path, f"{MODEL} (a key)", name, isinstance(name, str), "a str")
        if not name.endswith("_extra_state"):
            expect_field(path, f"{MODEL}.{name}", value, isinstance(value, torch.Tensor),
                         "a tensor")
    for field in (CALLBACKS, METRICS):
        if field in payload:
            expect_field(path, field, payload[field], isinstance(payload[field], Mapping), "a dict")
    if RANKS in payload:
        expect_field(path, RANKS, payload[RANKS], isinstance(payload[RANKS], list), "a list")


def check_payload(path: str, payload: Mapping[str, Any]) -> None:
    """Check the layout of a loaded hookloop checkpoint; name the first wrong field.

    A well-formed archive can still hold the wrong thing: a format this hookloop does not
    know, a training checkpoint without its optimizer or loop position, fields of the wrong
    type. Each is a `CheckpointError` naming the file and the field, instead of a raw
    KeyError/TypeError deep inside the resume.

    Rules: ``hookloop`` is a dict with an int ``format`` (1 up to `FORMAT`) and a ``kind``
    of ``"resume"`` or ``"best"``, and where present an int ``world_size`` >= 1, ints
    ``epoch`` and ``step`` >= 0 (also at the top level), str ``monitor`` and ``version``,
    and a number ``value``; ``model`` is a mapping of names to tensors; optional
    ``callbacks`` and ``metrics`` are dicts and ``ranks`` a list; a ``"resume"`` file also
    has ``optimizer`` (with ``state`` and ``param_groups``) and the loop's part
    (`check_run_fields`).

    Raises:
        CheckpointError: naming ``path`` and the field.

    Example:
        >>> check_payload("x.pt", {"hookloop": {"format": 1, "kind": "best"}, "model": {}})
        >>> check_payload("x.pt", {"hookloop": {"format": 9, "kind": "best"}, "model": {}})
        Traceback (most recent call last):
        ...
        hookloop.errors.CheckpointError: x.pt: written by a newer hookloop (format 9; this one reads up to 2); upgrade hookloop to read it.
    """
    kind = _check_meta(path, payload)
    _check_parts(path, payload)
    if kind != RESUME:
        return
    if OPTIMIZER not in payload:
        raise CheckpointError(
            f"{path}: a training checkpoint without its {OPTIMIZER!r} field; it cannot be "
            "resumed (hookloop.load_checkpoint(path, model) still loads the weights).")
    optimizer = payload[OPTIMIZER]
    expect_field(path, OPTIMIZER, optimizer, isinstance(optimizer, Mapping), "a dict")
    for field, kind_of in ((STATE, Mapping), (PARAM_GROUPS, list)):
        value = optimizer.get(field)
        expect_field(path, f"{OPTIMIZER}.{field}", value, isinstance(value, kind_of),
                     "a dict" if kind_of is Mapping else "a list")
    check_run_fields(path, payload)


def _check_history(path: str, history: Any) -> None:
    """Each row: a dict of metric names to numbers, with int ``epoch`` and ``step``."""
    expect_field(path, f"{LOOP}.{HISTORY}", history, isinstance(history, list), "a list of dicts")
    for index, row in enumerate(history):
        where = f"{LOOP}.{HISTORY}[{index}]"
        expect_field(path, where, row, isinstance(row, Mapping), "a dict")
        for field in (EPOCH, STEP):
            _expect_int(path, f"{where}.{field}", _require(path, row, where, field))
        for name, value in row.items():
            expect_field(path, f"{where} (a key)", name, isinstance(name, str), "a str")
            expect_field(path, f"{where}.{name}", value, _is_number(value), "a number")


def _check_ended(path: str, ended: Any) -> None:
    where = f"{LOOP}.{ENDED}"
    expect_field(path, where, ended, isinstance(ended, Mapping),
                 f"None or a dict with {REASON!r} and {EPOCHS!r}")
    expect_field(path, f"{where}.{REASON}", ended.get(REASON),
                 isinstance(ended.get(REASON), str), "a str")
    _expect_int(path, f"{where}.{EPOCHS}", ended.get(EPOCHS))
    _expect_int(path, f"{where}.{MAX_STEPS}", ended.get(MAX_STEPS), 1, optional=True)


def _check_strings(path: str, part: Mapping[str, Any]) -> None:
    """The loop part's optional strings and lists: the optimizer's class, its groups' sizes,
    a held stop's reason."""
    if part.get(OPTIMIZER_CLASS) is not None:
        expect_field(path, f"{LOOP}.{OPTIMIZER_CLASS}", part[OPTIMIZER_CLASS],
                     isinstance(part[OPTIMIZER_CLASS], str), "a str (the class name)")
    if part.get(PARAM_GROUPS) is not None:
        groups = part[PARAM_GROUPS]
        expect_field(path, f"{LOOP}.{PARAM_GROUPS}", groups, isinstance(groups, list) and all(
            _is_int(size) and size >= 0 for size in groups), "a list of ints >= 0")
    if part.get(STOP_HELD) is not None:
        expect_field(path, f"{LOOP}.{STOP_HELD}", part[STOP_HELD],
                     isinstance(part[STOP_HELD], str), "a str (a held stop's reason)")


def _check_loop_part(path: str, part: Any) -> None:
    expect_field(path, LOOP, part, isinstance(part, Mapping), "a dict")
    for field in (EPOCH, BATCH_IDX, STEP):
        _expect_int(path, f"{LOOP}.{field}", _require(path, part, LOOP, field))
    for field, minimum, optional in ((EPOCH_SAMPLES, 0, False), (WORLD_SIZE, 1, False),
                                     (EPOCHS, 0, False), (MAX_STEPS, 1, True),
                                     (GLOBAL_BATCH, 0, False)):
        if field in part:
            _expect_int(path, f"{LOOP}.{field}", part[field], minimum, optional=optional)
    if STEP_OFFSET in part:
        expect_field(path, f"{LOOP}.{STEP_OFFSET}", part[STEP_OFFSET],
                     _is_int(part[STEP_OFFSET]), "an int")
    if EPOCH_ORDER in part:
        expect_field(path, f"{LOOP}.{EPOCH_ORDER}", part[EPOCH_ORDER],
                     isinstance(part[EPOCH_ORDER], str), "a str (the sampler's order)")
    if VALIDATED in part:
        expect_field(path, f"{LOOP}.{VALIDATED}", part[VALIDATED],
                     isinstance(part[VALIDATED], bool), "a bool")
    _check_strings(path, part)
    if part.get(HISTORY) is not None:
        _check_history(path, part[HISTORY])
    if part.get(ENDED) is not None:
        _check_ended(path, part[ENDED])


def _check_rank_part(path: str, where: str, part: Any) -> None:
    """One rank's own part: loss sums, counters and its generators' states."""
    expect_field(path, where, part, isinstance(part, Mapping), "a dict")
    for field in (TRAIN_SAMPLES, MARK_BATCHES, DRAWN_AHEAD):
        if field in part:
            _expect_int(path, f"{where}.{field}", part[field])
    if part.get(TRAIN_LOSS_SUM) is not None:
        expect_field(path, f"{where}.{TRAIN_LOSS_SUM}", part[TRAIN_LOSS_SUM],
                     isinstance(part[TRAIN_LOSS_SUM], torch.Tensor), "a tensor or None")
    workers = part.get(WORKERS_RNG)
    if workers is not None:
        expect_field(path, f"{where}.{WORKERS_RNG}", workers, isinstance(workers, list),
                     "a list (a generator state or None for each DataLoader worker)")
    states = [(name, part.get(name)) for name in (RNG, EPOCH_RNG, PREFETCH_RNG, MARK_RNG)]
    states += [(f"{WORKERS_RNG}[{i}]", item) for i, item in enumerate(workers or ())]
    for field, state in states:
        problem = rng_state_problem(state) if state is not None else None
        if problem is not None:
            inner, value, expected = problem
            expect_field(path, f"{where}.{field}" + (f".{inner}" if inner else ""), value,
                         False, expected)


def check_run_fields(path: str, payload: Mapping[str, Any]) -> None:
    """Check the loop's part of a training checkpoint (what `run_payload` lays out); name
    the first wrong field.

    ``loop`` is a dict with int ``epoch``, ``batch_idx`` and ``step`` >= 0; where present,
    a bool ``validated``, an int ``world_size`` >= 1, a str ``optimizer_class``, a list of
    ints ``param_groups``, an int ``epochs`` >= 0, ``max_steps`` None or an int >= 1, a list
    ``history`` of rows (dicts of numbers with int ``epoch`` and ``step``) and ``ended``
    None or a dict (str ``reason``, int ``epochs``, ``max_steps`` None or an int), and
    ``stop_held`` None or a str. Each rank's part in ``ranks`` is a dict whose loss sums
    and generator states (`rng_state_problem`) have their types. A value of another type
    (a text ``world_size``, a float ``step``) is refused rather than converted.

    Raises:
        CheckpointError: naming ``path`` and the field.

    Example:
        >>> check_run_fields("x.pt", {"loop": {"epoch": 1, "batch_idx": 0, "step": -4}})
        Traceback (most recent call last):
        ...
        hookloop.errors.CheckpointError: x.pt: the checkpoint's field 'loop.step' is int (-4), expected an int >= 0. The file was not written by this version of hookloop or was edited; resume from another file.
    """
    if LOOP not in payload:
        raise CheckpointError(
            f"{path}: a training checkpoint without its {LOOP!r} field (the position to "
            "resume from); it cannot be resumed.")
    _check_loop_part(path, payload[LOOP])
    for index, part in enumerate(payload.get(RANKS) or []):
        _check_rank_part(path, f"{RANKS}[{index}]", part)


def _is_byte_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8


def _host_rng_problem(state: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    for field, size in ((RNG_PYTHON, 3), (RNG_NUMPY, 5)):
        if field in state and (not isinstance(state[field], list) or len(state[field]) != size):
            return field, state[field], f"a list of {size} items"
    if RNG_PYTHON in state:
        version, words, gauss = state[RNG_PYTHON]
        for index, value, ok, expected in (
                (0, version, _is_int(version), "an int (the generator's version)"),
                (1, words, isinstance(words, list) and all(_is_int(word) for word in words),
                 "a list of ints"),
                (2, gauss, gauss is None or isinstance(gauss, float), "a float or None")):
            if not ok:
                return f"{RNG_PYTHON}[{index}]", value, expected
    if RNG_NUMPY in state:
        kind, keys, position, has_gauss, cached = state[RNG_NUMPY]
        for index, value, ok, expected in (
                (0, kind, isinstance(kind, str), "a str"),
                (1, keys, isinstance(keys, torch.Tensor) and keys.dtype == torch.int64,
                 "an int64 tensor"),
                (2, position, _is_int(position), "an int"),
                (3, has_gauss, _is_int(has_gauss), "an int"),
                (4, cached, isinstance(cached, float), "a float")):
            if not ok:
                return f"{RNG_NUMPY}[{index}]", value, expected
    return None


def rng_state_problem(state: Any) -> tuple[str, Any, str] | None:
    """The first field of a saved `hookloop.engine.rng.capture_rng` state with the wrong type, or
    None.

    A checkpoint file read back may have been edited or written by another program;
    restoring a wrong state fails deep inside torch or NumPy without naming the field.

    Returns:
        ``(field, value, expected)``: the field's name inside the state (``""`` for the
        state itself), its value, and what it should be.

    Example:
        >>> from hookloop.engine.rng import capture_rng
        >>> rng_state_problem(capture_rng()) is None
        True
        >>> rng_state_problem({"torch": "abc"})
        ('torch', 'abc', 'a uint8 tensor')
    """
    if not isinstance(state, Mapping):
        return "", state, "a dict"
    if not _is_byte_tensor(state.get(RNG_TORCH)):
        return RNG_TORCH, state.get(RNG_TORCH), "a uint8 tensor"
    for field in (RNG_GENERATORS, RNG_CUDA):
        states = state.get(field, [])
        if not isinstance(states, list):
            return field, states, "a list of uint8 tensors"
        for index, item in enumerate(states):
            if not _is_byte_tensor(item):
                return f"{field}[{index}]", item, "a uint8 tensor"
    return _host_rng_problem(state)


# --------------------------------------------------------------------------- reading
def _check_container(path: str) -> None:
    """The file is there, not empty, and a whole ``torch.save`` archive (its CRCs checked
    by `hookloop.runfile.storage.verify_archive`), or a legacy pickle."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            head = handle.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file.") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({describe_os_error(error)}).") from None
    if size == 0:
        raise CheckpointError(
            f"{path}: the file is empty (0 bytes), not a checkpoint. It was not written by "
            "hookloop, which never leaves a partial file under a final name; delete it.")
    try:
        is_zip = zipfile.is_zipfile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        is_zip = False
    if head.startswith(b"PK") and not is_zip:
        raise CheckpointError(
            f"{path}: the file is truncated or corrupt ({size} bytes; its zip archive has no "
            "central directory, so its end is missing). Delete it to resume from an older "
            "checkpoint.")
    if not head.startswith(b"PK") and not head.startswith(b"\x80"):
        raise CheckpointError(
            f"{path}: not a checkpoint (it is not a file written by torch.save; it starts "
            f"with {head!r}).")
    if head.startswith(b"PK"):
        verify_archive(path)


def _load(path: str, map_location: Any) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - every failure becomes one clear error
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "weights_only" in str(error) or "Weights only" in str(error):
            raise CheckpointError(
                f"{path}: holds objects that torch.load(weights_only=True) refuses ({text}), so "
                "it was not written by hookloop. hookloop never falls back to unsafe pickle "
                "loading; if you trust the file, load it yourself with "
                "torch.load(path, weights_only=False).") from None
        raise CheckpointError(f"{path}: the file is corrupt or not a checkpoint "
                              f"({type(error).__name__}: {text}).") from None


def read_payload(path: str | os.PathLike[str], map_location: Any) -> dict[str, Any]:
    """Load a hookloop checkpoint file safely, or raise `CheckpointError` saying what is
    wrong.

    The archive's CRCs are checked first (`hookloop.runfile.storage.verify_archive`), then it is
    loaded with ``torch.load(weights_only=True)`` and its layout checked (`check_payload`).
    """
    path = os.fspath(path)
    _check_container(path)
    payload = _load(path, map_location)
    if not isinstance(payload, dict) or not isinstance(payload.get(META), dict):
        keys = (f"top-level keys: {', '.join(map(str, list(payload)[:8]))}"
                if isinstance(payload, dict)
                else f"it holds {with_article(type(payload).__name__)}")
        raise CheckpointError(
            f"{path}: not a hookloop checkpoint ({keys}; no {META!r} entry). Load it with "
            "torch.load, or use a file written by hookloop.callbacks.Checkpoint.")
    if not isinstance(payload.get(MODEL), Mapping):
        raise CheckpointError(f"{path}: the checkpoint has no model weights ({MODEL!r} entry).")
    check_payload(path, payload)
    return payload
