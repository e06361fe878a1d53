"""The weights' part of the run file (`Weights`: the model and the optimizer, plain or
sharded, written, checked and read here); loading saved weights and optimizer states into a
model and an optimizer, refusing what does not fit by name; and whether weights are finite
before a save."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from hookloop import distributed
from hookloop.base.modules import unwrap
from hookloop.errors import CheckpointError, ConfigurationError, expect_field, with_article
from hookloop.runfile.format import (LOOP, MODEL, OPTIMIZER, PARAM_GROUPS, PARAMS, SHARDS,
                                     register_check)
from hookloop.runfile.sharded import (
    is_distributed_module,
    is_sharded_tensor,
    layout_of,
    load_full_model_state,
    load_full_optimizer_state,
    model_state,
    optimizer_state,
)

__all__ = ["KEYS", "Weights", "finite_model_state", "non_finite_weights_advice", "run_is_finite",
           "check_loadable", "check_optimizer_fits", "check_weight_dtypes", "weight_differences",
           "load_model_weights", "load_optimizer_state", "load_weights", "all_finite"]

#: ``loop.optimizer_class``: the optimizer's class; ``loop.param_groups`` (the envelope's
#: key) holds its groups' sizes.
OPTIMIZER_CLASS = "optimizer_class"
KEYS = (OPTIMIZER_CLASS,)
SHARED_WORDS: frozenset[str] = frozenset()


class Weights:
    """The model (``model()``: the loop's ``wrapped()`` model without its wrappers) and the
    optimizer: ``model`` and
    ``optimizer`` of the file, as `hookloop.runfile.sharded` gives them (gathered to rank 0,
    or this rank's shards), and ``loop``'s optimizer class and group sizes.

    A save asks `layout` once: the layout of a sharded model (None: not sharded), kept in
    ``saving`` for the parts written after it (the callbacks' DTensors follow the model).
    """

    def __init__(self, wrapped: Callable[[], nn.Module],
                 optimizer: Callable[[], torch.optim.Optimizer]) -> None:
        self.wrapped, self.optimizer = wrapped, optimizer
        self.saving: str | None = None
        self._unwrapped: tuple[nn.Module, nn.Module] | None = None  # (wrapped, model)

    def model(self) -> nn.Module:
        """The model without its wrappers, unwrapped once for each model the loop holds
        (DDP or ``torch.compile`` wrap it at setup), not at every save."""
        wrapped = self.wrapped()
        if self._unwrapped is None or self._unwrapped[0] is not wrapped:
            self._unwrapped = (wrapped, unwrap(wrapped))
        return self._unwrapped[1]

    def layout(self, gather: bool) -> str | None:
        """This save's layout of the model's state, decided once per save.

        Raises:
            CheckpointError: ``gather=False`` (the exception path) with a sharded model
                (FSDP, tensor parallel, DTensor parameters), whose state cannot be read or
                written without every rank.
        """
        model = self.model()
        self.saving = layout_of(model)
        if not gather and (self.saving is not None or is_distributed_module(model)):
            raise CheckpointError(
                "no checkpoint of the exception: the state of a sharded model (FSDP, tensor "
                "parallel, DTensor parameters) is read by every rank together, and on the "
                "exception path the other ranks may be dead or elsewhere. The newest "
                "checkpoint stays the one to resume from; a stop every rank agrees on "
                "(loop.stop(), a stop signal) writes one.")
        return self.saving

    def state_dict(self) -> dict[str, Any]:
        module, optimizer = self.model(), self.optimizer()
        if self.saving is None:  # not sharded (`layout` asked at this save)
            model, optim = module.state_dict(), optimizer.state_dict()
        else:
            model, optim = model_state(module), optimizer_state(module, optimizer)
        return {MODEL: model, OPTIMIZER: optim,
                LOOP: {OPTIMIZER_CLASS: type(optimizer).__qualname__,
                       PARAM_GROUPS: [len(group[PARAMS]) for group in optimizer.param_groups]}}

    @staticmethod
    def check_file(source: str, saved: Mapping[str, Any]) -> None:
        """``loop``'s optimizer class and group sizes have their types."""
        part = saved[LOOP]
        if part.get(OPTIMIZER_CLASS) is not None:
            expect_field(source, f"{LOOP}.{OPTIMIZER_CLASS}", part[OPTIMIZER_CLASS],
                         isinstance(part[OPTIMIZER_CLASS], str), "a str (the class name)")
        if part.get(PARAM_GROUPS) is not None:
            groups = part[PARAM_GROUPS]
            expect_field(source, f"{LOOP}.{PARAM_GROUPS}", groups, isinstance(groups, list) and all(
                isinstance(size, int) and not isinstance(size, bool) and size >= 0
                for size in groups), "a list of ints >= 0")

    def check(self, saved: Mapping[str, Any], source: str) -> None:
        """A training state of this optimizer's class and param-group layout."""
        missing = [key for key in (MODEL, OPTIMIZER) if not isinstance(saved.get(key), Mapping)]
        if missing:
            raise CheckpointError(f"{source}: not a training state: {', '.join(missing)} "
                                  "missing or not a mapping.")
        self.check_file(source, saved)
        check_optimizer_fits(self.optimizer(), saved[LOOP], saved[OPTIMIZER], source)

    def load_state_dict(self, saved: Mapping[str, Any], source: str = "the state") -> None:
        """A file or a directory of shards, into a sharded model or not (`load_weights`)."""
        load_weights(source, self.model(), self.optimizer(), saved)


def check_optimizer_fits(optimizer: torch.optim.Optimizer, loop_part: Mapping[str, Any],
                         saved: Mapping[str, Any], source: str) -> None:
    """Another optimizer class or param-group layout is refused, naming both."""
    ours = type(optimizer).__qualname__
    theirs = loop_part.get(OPTIMIZER_CLASS)
    if theirs is not None and theirs != ours:
        raise CheckpointError(
            f"{source}: the run was trained with {theirs}, but this loop's optimizer is "
            f"{ours}; its state (momentum buffers, moments, hyper-parameters) cannot be "
            f"loaded into another class. Create {with_article(theirs)} as in the saved run, or "
            "load only the weights with hookloop.load_checkpoint(path, model) and start a new run.")
    layout = [len(group[PARAMS]) for group in optimizer.param_groups]
    groups = saved.get(PARAM_GROUPS)
    saved_layout = ([len(group.get(PARAMS, ())) for group in groups]
                    if isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups)
                    else loop_part.get(PARAM_GROUPS))
    if saved_layout is not None and list(saved_layout) != layout:
        raise CheckpointError(
            f"{source}: the saved optimizer has param groups of sizes {list(saved_layout)}, "
            f"this loop's {ours} has {layout}. Build the optimizer over the same parameters "
            "in the same groups as the saved run.")


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating-point" if dtype.is_floating_point else "integer"


def check_weight_dtypes(path: str, model: nn.Module, weights: Mapping[str, Any]) -> None:
    """Refuse saved weights of another kind than the model's; say when floats are converted.

    ``load_state_dict`` copies whatever it is given into the model's tensors, converting
    silently: int64 weights (an edited file) load into a float model as rounded values,
    and a float ``num_batches_tracked`` into an int buffer. A saved tensor whose kind
    (bool, integer, floating-point, complex) differs from the model's entry is refused.

    Another floating-point dtype of the same entry (float64 or bfloat16 saved, a float32
    model; float32 saved into a half model for inference) is converted, as torch does, with
    a `RuntimeWarning` naming the entries: each value keeps its meaning and only its
    precision changes, and loading full-precision weights into a half or bfloat16 model is
    a common, deliberate use. A resumed run with converted weights does not continue bit
    for bit, which the warning says.

    Raises:
        CheckpointError: naming ``path``, the field and both dtypes.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> check_weight_dtypes("x.pt", model, {"weight": torch.ones(1, 2, dtype=torch.int64)})
        Traceback (most recent call last):
        ...
        hookloop.errors.CheckpointError: x.pt: the checkpoint's field 'model.weight' holds torch.int64 values, but the model's weight is torch.float32: an integer tensor does not load into a floating-point one without changing what it holds (torch would convert it silently). The file was edited or written for another model; resume from another file.
    """
    entries = model.state_dict()
    converted: list[str] = []
    for name, saved in weights.items():
        ours = entries.get(name)
        if not isinstance(saved, torch.Tensor) or not isinstance(ours, torch.Tensor) \
                or saved.dtype == ours.dtype:
            continue
        theirs, kind = _dtype_kind(saved.dtype), _dtype_kind(ours.dtype)
        if theirs != kind:
            raise CheckpointError(
                f"{path}: the checkpoint's field 'model.{name}' holds {saved.dtype} values, but "
                f"the model's {name} is {ours.dtype}: {with_article(theirs)} tensor does not "
                f"load into {with_article(kind)} one without changing what it holds (torch "
                "would convert it silently). The file was edited or written for another "
                "model; resume from another file.")
        converted.append(f"'model.{name}' ({saved.dtype} into {ours.dtype})")
    if converted:
        more = f" and {len(converted) - 3} more" if len(converted) > 3 else ""
        warnings.warn(
            f"{path}: {len(converted)} weight(s) were saved in another floating-point dtype than "
            f"the model's and are converted to the model's: {', '.join(converted[:3])}{more}. "
            "Values lose precision where the model's dtype is narrower, and a resumed run "
            "does not continue bit for bit; cast the model to the saved dtype first to load "
            "them as they are.", RuntimeWarning, stacklevel=3)


def weight_differences(model: nn.Module, weights: Mapping[str, Any]) -> list[str]:
    """Each tensor where ``weights`` and ``model`` differ, in the model's order, then the
    file's: a shape, a name only one side has.

    Example:
        >>> weight_differences(nn.Linear(3, 8), nn.Linear(3, 4).state_dict())
        ["'weight': saved (4, 3), the model's (8, 3)", "'bias': saved (4,), the model's (8,)"]
    """
    own = model.state_dict()
    found = []
    for name, tensor in own.items():
        saved = weights.get(name)
        if name not in weights:
            found.append(f"{name!r}: in the model, not in the file")
        elif isinstance(saved, torch.Tensor) and isinstance(tensor, torch.Tensor) and \
                saved.shape != tensor.shape:
            found.append(f"{name!r}: saved {tuple(saved.shape)}, the model's {tuple(tensor.shape)}")
    found += [f"{name!r}: in the file, not in the model" for name in weights if name not in own]
    return found


def load_model_weights(path: str, model: nn.Module, weights: Mapping[str, Any], *,
                       strict: bool = True) -> None:
    """``model.load_state_dict(weights)``, refusing another kind of dtype
    (`check_weight_dtypes`) and naming ``path``, the first tensor that differs and the way
    to load anyway when the weights do not fit. ``strict=False`` loads the tensors whose
    names and shapes match, and warns which it left as they were."""
    check_weight_dtypes(path, model, weights)
    if not strict:
        own = model.state_dict()
        fitting = {name: value for name, value in weights.items() if name in own and (
            not isinstance(value, torch.Tensor) or value.shape == own[name].shape)}
        skipped = weight_differences(model, weights)
        model.load_state_dict(fitting, strict=False)
        if skipped:
            warnings.warn(f"{path}: loaded {len(fitting)} of the model's {len(own)} tensors "
                          f"(strict=False); left as they were: {'; '.join(skipped[:5])}"
                          f"{'...' if len(skipped) > 5 else ''}.", RuntimeWarning, stacklevel=3)
        return
    try:
        model.load_state_dict(weights)
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        differences = weight_differences(model, weights)
        if not differences:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            raise CheckpointError(f"{path}: the weights do not fit the model (wrong "
                                  f"architecture): {' '.join(lines)[:600]}") from None
        others = f" ({len(differences) - 1} more differ)" if len(differences) > 1 else ""
        raise CheckpointError(
            f"{path}: the weights do not fit the model (wrong architecture): the first tensor "
            f"that differs is {differences[0]}{others}. A run resumes only into the model "
            "that saved it: build that model again. To start a new run from these weights "
            "in the changed model (a new Checkpoint dirpath, or resume=False), load what fits "
            "with hookloop.load_checkpoint(path, model, strict=False): it loads the tensors "
            "whose names and shapes match and leaves the others as initialized.") from None


def load_optimizer_state(path: str, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    try:
        optimizer.load_state_dict(dict(state))
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as error:
        raise CheckpointError(
            f"{path}: the optimizer state does not fit this optimizer ({error}). Create the "
            "same optimizer over the same parameters as the run that saved it.") from None


def check_loadable(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                   payload: Mapping[str, Any], *, strict: bool = True) -> None:
    """Before `load_weights` of a file a user names (`hookloop.load_checkpoint`).

    Raises:
        CheckpointError: an ``optimizer`` to load and no optimizer state in the file (a
            best file).
        ConfigurationError: ``strict=False`` with shards in the file or in the model.
    """
    if optimizer is not None and OPTIMIZER not in payload:
        raise CheckpointError(
            f"{path}: holds no optimizer state (best.pt keeps only the validated weights); "
            "load a rotating checkpoint to restore the optimizer.")
    if not strict and (payload.get(SHARDS) is not None or is_distributed_module(model)):
        raise ConfigurationError(
            f"load_checkpoint(strict=False) loads a checkpoint file into an unsharded model; "
            f"{path} is sharded or the model is: load it strictly, or write the run with "
            "FSDP(state_dict='full') and load that file into an unsharded model.")


def load_weights(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 payload: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load the weights (and the optimizer's state) of a checkpoint's ``payload`` into
    ``model``, whatever the pair: a file or a directory of shards, into a sharded (FSDP) or
    an unsharded model.

    A file's full tensors go into a sharded model each rank keeping its shards; a
    directory's shards are read by DCP, re-sharded to this run's ranks (or read whole for
    an unsharded model). A file into an unsharded model is ``load_state_dict``.

    Raises:
        CheckpointError: the weights or the optimizer state do not fit, naming ``path``.
    """
    shards = payload.get(SHARDS)
    if shards is not None:
        groups = payload[OPTIMIZER].get(PARAM_GROUPS) if optimizer is not None else None
        shards.load(model, optimizer, groups)
        return
    if not is_distributed_module(model):
        load_model_weights(path, model, payload[MODEL], strict=strict)
        if optimizer is not None:
            load_optimizer_state(path, optimizer, payload[OPTIMIZER])
        return
    try:
        load_full_model_state(model, payload[MODEL])
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        detail = " ".join(str(error).split())[:600]
        raise CheckpointError(
            f"{path}: the weights do not fit the model (wrong architecture): {detail}") from None
    if optimizer is not None:
        try:
            load_full_optimizer_state(model, optimizer, payload[OPTIMIZER])
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as error:
            raise CheckpointError(
                f"{path}: the optimizer state does not fit this optimizer ({error}). Create "
                "the same optimizer over the same parameters as the run that saved it.") from None


def all_finite(weights: Mapping[str, Any], *, agree: bool = False,
               sharded: bool | None = None) -> bool:
    """True when every floating tensor of ``weights`` is finite.

    Shards (FSDP's DTensors) are checked on this rank and the answer is agreed by every
    rank, as it is with ``agree`` (a collective then: every rank must call it; rank 0 may
    hold the gathered weights while the others hold none). ``sharded``: whether they are
    shards, as decided for the fit (`hookloop.runfile.sharded.saves_shards`); None looks
    at the tensors.

    Example:
        >>> all_finite({"w": torch.tensor([1.0, float("nan")])})
        False
    """
    tensors = [value for value in weights.values() if isinstance(value, torch.Tensor)]
    if sharded is None:
        sharded = any(is_sharded_tensor(value) for value in tensors)
    local = [cast(Any, value).to_local() if sharded and is_sharded_tensor(value) else value
             for value in tensors if value.is_floating_point()]
    # A sum reads each tensor once and allocates nothing: a NaN or an inf anywhere makes it
    # non-finite. Only a tensor whose sum is not finite (an inf, a NaN, or finite values
    # whose sum overflows, as float16 ones may) is checked element by element.
    sums = [torch.isfinite(value.sum()) for value in local]
    finite = bool(torch.stack([check.cpu() for check in sums]).all()) if sums else True
    if not finite:
        finite = all(bool(torch.isfinite(value).all()) for value, check in zip(local, sums)
                     if not bool(check))
    if agree or sharded:
        finite = not distributed.any_true(not finite)
    return finite


def run_is_finite(run: Mapping[str, Any], *, agree: bool, sharded: bool) -> bool:
    """`all_finite` of the weights of ``run`` (`hookloop.loop.Loop.state_dict`), shards or
    not as its save decided."""
    return all_finite(run[MODEL], agree=agree, sharded=sharded)


def finite_model_state(module: nn.Module) -> dict[str, Any] | None:
    """``module``'s state as a checkpoint saves it (gathered, or shards under FSDP), or None
    where it is not finite (every rank asks, and every rank gets the same answer)."""
    weights = model_state(module)
    return weights if all_finite(weights, agree=True) else None


def non_finite_weights_advice(callbacks: Sequence[Any]) -> str:
    """What to tell a user whose weights became non-finite, given the stack they run.

    For `Checkpoint`'s "weights are not finite" warning: advise adding `TerminateOnNaN`
    only when it is not there already.

    Example:
        >>> non_finite_weights_advice([])[:24]
        'Add TerminateOnNaN() to '
    """
    # By class name, as ordering constraints name classes: the core imports no callback.
    present = [callback for callback in callbacks
               if any(cls.__name__ == "TerminateOnNaN" for cls in type(callback).__mro__)]
    if not present:
        return ("Add TerminateOnNaN() to stop before a non-finite loss or gradient reaches "
                "the weights.")
    if not getattr(present[0], "check_gradients", True):
        return ("TerminateOnNaN(check_gradients=False) only watches the loss; a finite loss "
                "with non-finite gradients passed it. Use TerminateOnNaN() to check both.")
    return ("TerminateOnNaN is in the stack and saw finite losses and gradients, so the "
            "optimizer step itself (a learning rate or eps that overflows), a callback that "
            "writes the weights, or weights that were non-finite from the start made them so.")


register_check(Weights.check_file)
