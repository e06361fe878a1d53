"""The checks of the `Loop`'s own arguments: at construction, at ``fit``, after setup.

Each mistake found here would otherwise fail late (after an epoch), raw (a TypeError
from deep inside torch), or not at all (training nothing). The generic checks they use
(`hookloop.base.checks.check_int`...) are in `hookloop.base.checks`.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from hookloop import distributed
from hookloop.callback import Callback
from hookloop.base.checks import (check_choice, check_flag, check_int, check_name,
                                  check_optional_int, is_int, refusal, resolve_device)
from hookloop.engine.data import find_targets, length_of
from hookloop.engine.ordering import check_callbacks
from hookloop.errors import ConfigurationError, with_article

__all__ = ["check_loop_arguments", "check_loss_reduction", "check_learning_rates",
           "check_extra_state", "check_fit",
           "check_fit_arguments", "check_fit_data", "check_evaluation", "check_setup"]


def check_loss_reduction(value: Any, loss_fn: Any) -> str:
    """``Loop(loss_reduction=...)`` as ``"mean"`` or ``"sum"``; ``"auto"`` reads the
    ``reduction`` of a torch loss module (``nn.MSELoss(reduction="sum")``) or of a
    ``functools.partial`` (``partial(F.mse_loss, reduction="sum")``), else ``"mean"``.

    Example:
        >>> import torch
        >>> check_loss_reduction("auto", torch.nn.MSELoss(reduction="sum"))
        'sum'
        >>> check_loss_reduction("auto", torch.nn.functional.mse_loss)
        'mean'
        >>> import functools
        >>> check_loss_reduction("auto", functools.partial(torch.nn.functional.l1_loss,
        ...                                                reduction="sum"))
        'sum'
    """
    check_choice("Loop loss_reduction", value, ("auto", "mean", "sum"),
                 hint="'mean': each batch's loss is its mean (weighted by the batch size); "
                      "'sum': it is the sum over its samples; 'auto' reads loss_fn.reduction.")
    if isinstance(loss_fn, functools.partial):  # partial(F.mse_loss, reduction="sum")
        reduction = loss_fn.keywords.get("reduction")
    else:
        reduction = getattr(loss_fn, "reduction", None)
    # KLDivLoss's "batchmean" divides by the batch size: a mean per sample, as "mean".
    read = {"mean": "mean", "batchmean": "mean", "sum": "sum"}.get(str(reduction))
    if value != "auto" and read is not None and read != value:
        name = f"partial({getattr(loss_fn.func, '__name__', 'loss')})" if isinstance(
            loss_fn, functools.partial) else type(loss_fn).__name__
        raise ConfigurationError(
            f"Loop loss_reduction={value!r} contradicts loss_fn {name}, whose reduction is "
            f"{reduction!r}: the epoch losses would take each batch's loss as its "
            f"{value}, so train_loss and val_loss would be off by the "
            "batch size. Leave loss_reduction='auto' (it reads loss_fn's reduction), or build "
            f"the loss with reduction={value!r}.")
    if value != "auto":
        return value
    if reduction == "none":
        raise ConfigurationError(
            f"loss_fn {type(loss_fn).__name__}(reduction='none') returns one loss per sample, "
            "but the loop needs a scalar. Build it with reduction='mean' (or 'sum', then the "
            "epoch losses are divided by the number of samples).")
    return "sum" if reduction == "sum" else "mean"


def _check_data(data: Any, name: str) -> None:
    if data is None:
        raise ConfigurationError(
            f"{name} is None: pass an iterable of batches, usually "
            "torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True).")
    if isinstance(data, Dataset) and not isinstance(data, (IterableDataset, DataLoader)):
        raise ConfigurationError(
            f"{name} is {with_article(type(data).__name__)}, a torch Dataset: iterating it gives "
            "one sample at a time, not batches, so training would see batches of one sample "
            f"without a batch dimension. Wrap it: {name}=DataLoader(dataset, batch_size=32"
            f"{', shuffle=True' if name == 'train_data' else ''}).")
    if isinstance(data, (str, bytes, torch.Tensor)) or not (
            hasattr(data, "__iter__") or hasattr(data, "__getitem__")):
        raise ConfigurationError(
            f"{name} must be an iterable of batches (a DataLoader, a list of (inputs, "
            f"targets) pairs...), got {type(data).__name__}. A tensor of inputs needs "
            "targets and batching: DataLoader(TensorDataset(inputs, targets), batch_size=32).")


def _sample_problem(item: Any) -> str | None:
    """Why the first item of a list of training data looks like one sample, not a batch
    (None when it may be a batch): targets without a batch dimension (a number, a 0-d
    tensor), or 1-d inputs whose length is not the targets' (a batch's agree)."""
    if not isinstance(item, (tuple, list, Mapping)) or (
            isinstance(item, (tuple, list)) and len(item) != 2):
        return None
    targets = find_targets(item)
    inputs = item[0] if isinstance(item, (tuple, list)) else None
    if isinstance(targets, (int, float)) and not isinstance(targets, bool):
        return f"its targets are the number {targets!r}"
    if isinstance(targets, torch.Tensor) and targets.dim() == 0:
        return f"its targets are a 0-d tensor ({targets.item()!r})"
    if isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor) and \
            inputs.dim() == 1 and targets.dim() >= 1 and inputs.shape[0] != targets.shape[0]:
        return (f"its inputs have shape {tuple(inputs.shape)} and its targets "
                f"{tuple(targets.shape)}, while a batch's share the first (batch) dimension")
    return None


def _check_samples(data: Any, name: str) -> None:
    """A list of samples (``list(dataset)``) as the data: each step would see one sample
    without a batch dimension (a silent batch size of one, or torch's "mat1 and mat2")."""
    if not isinstance(data, (list, tuple)) or not data:
        return
    problem = _sample_problem(data[0])
    if problem is not None:
        raise ConfigurationError(
            f"{name} looks like a list of samples, not of batches: its first item is "
            f"{with_article(type(data[0]).__name__)} and {problem}, so every step would train "
            "on one sample without a batch dimension. For a list of samples: wrap it in a "
            f"DataLoader, {name}=DataLoader(samples, batch_size=32"
            f"{', shuffle=True' if name == 'train_data' else ''}), which stacks them into "
            "batches (or pass forward=fn(loop, batch) -> (outputs, loss) if each item is "
            "meant as it is).")


def _check_callable(value: Any, name: str, signature: str) -> None:
    if value is None:
        return
    if isinstance(value, type):
        raise ConfigurationError(
            f"{name} is the class {value.__name__}, not an instance or a function: write "
            f"{name}={value.__name__}() (it is called as {signature}).")
    if not callable(value):
        raise ConfigurationError(
            f"{name} must be a function {signature} or None, got {value!r} "
            f"({type(value).__name__}).")


def check_extra_state(state: Any, model: Any = None, optimizer: Any = None) -> dict[str, Any]:
    """``Loop(state=...)``: names mapped to objects with ``state_dict`` and ``load_state_dict``.

    Refused: a class instead of an instance (``state={"d": nn.Linear}`` has the methods,
    unbound, and failed at the first save); one object under two names (restored twice);
    the loop's own ``model`` or ``optimizer`` (saved already). What the objects' states
    hold is checked at fit start (`hookloop.engine.stateful.check_callback_states`).

    Example:
        >>> import torch
        >>> sorted(check_extra_state({"discriminator": torch.nn.Linear(2, 1)}))
        ['discriminator']
        >>> check_extra_state({"discriminator": torch.nn.Linear})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: Loop state['discriminator'] is the class Linear, not an instance: ...
    """
    if state is None:
        return {}
    if not isinstance(state, dict) or isinstance(state, nn.Module):
        raise ConfigurationError(
            f"Loop state must be a dict of name -> object with state_dict/load_state_dict "
            f"(e.g. state={{'discriminator': net_d, 'opt_d': opt_d}}), got {type(state).__name__}.")
    names: dict[int, str] = {}
    for name, item in state.items():
        check_name("Loop state key", name, optional=False)
        if isinstance(item, type):
            raise ConfigurationError(
                f"Loop state[{name!r}] is the class {item.__name__}, not an instance: its "
                "state_dict could not be saved. Pass the object the run uses: "
                f"state={{{name!r}: {item.__name__[:1].lower() + item.__name__[1:]}}} where "
                f"{item.__name__[:1].lower() + item.__name__[1:]} = {item.__name__}(...).")
        if not (callable(getattr(item, "state_dict", None))
                and callable(getattr(item, "load_state_dict", None))):
            raise ConfigurationError(
                f"Loop state[{name!r}] (of type {type(item).__name__}) has no state_dict() and "
                "load_state_dict(): the loop saves and restores each object of state= through "
                "them (a module, an optimizer, a scheduler, a GradScaler...).")
        for own, what in ((model, "model"), (optimizer, "optimizer")):
            if item is own:
                raise ConfigurationError(
                    f"Loop state[{name!r}] is the loop's {what}, which the run saves and "
                    f"restores already (under {what!r}): remove it from state=.")
        if id(item) in names:
            raise ConfigurationError(
                f"Loop state[{names[id(item)]!r}] and state[{name!r}] are the same "
                f"{type(item).__name__} object: it would be saved twice and restored twice. "
                "Keep one name for it.")
        names[id(item)] = name
    return dict(state)


def _check_selector(label: str, selector: Any) -> None:
    """``Loop(inputs=..., targets=...)``: None, a key (str or int) or a function of a batch."""
    if selector is None or (isinstance(selector, str) and selector) or (
            is_int(selector) and selector >= 0):
        return
    if callable(selector) and not isinstance(selector, type):
        _check_arity(selector, label, 1, f"{label}(batch)", "It gets the batch and returns "
                     f"the {label}.")
        return
    raise refusal(f"Loop {label}", "a key of the batch (e.g. 'image'), an index, or a function "
                  "fn(batch)", selector)


def _check_arity(function: Any, name: str, count: int, call: str, hint: str) -> None:
    """``function`` must accept ``count`` positional arguments, as the loop will call it.

    Read from its signature (no call is made); a function whose signature cannot be read
    (some builtins) passes.
    """
    if function is None:
        return
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(count))
    except TypeError:
        label = getattr(function, "__qualname__", None) or type(function).__name__
        raise ConfigurationError(
            f"{name} is called as {call}, with {count} arguments, but {label}{signature} "
            f"cannot take them. {hint}") from None


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    if not callable(getattr(optimizer, "step", None)) or not hasattr(optimizer, "param_groups"):
        raise ConfigurationError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}. "
            "Create one over the model's parameters: torch.optim.AdamW(model.parameters()).")
    check_learning_rates(optimizer)
    model_parameters = {id(parameter) for parameter in model.parameters()}
    optimized = [parameter for group in optimizer.param_groups
                 for parameter in group.get("params", ())]
    if model_parameters and optimized and not any(id(parameter) in model_parameters
                                                  for parameter in optimized):
        raise ConfigurationError(
            f"The optimizer holds {len(optimized)} parameter tensor(s), none of which is a "
            f"parameter of the model ({type(model).__name__}), so training would change "
            "nothing. Create the optimizer from this model: "
            "torch.optim.AdamW(model.parameters()), after building (or replacing) the model.")


def check_learning_rates(optimizer: Any, when: str = "") -> None:
    """Every param group's learning rate is a finite number >= 0.

    Checked when the loop is built and again at every ``fit`` start (``when``: ``" at fit
    start"``), since ``param_groups`` can be edited in between; a tensor rate is read once
    per check, never per batch.

    Raises:
        ConfigurationError: naming the param group, the rate and the fix.

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> optimizer.param_groups[0]["lr"] = -0.1
        >>> check_learning_rates(optimizer, " at fit start")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: The optimizer's param group 0 has the learning rate -0.1 at fit start: ...
    """
    for index, group in enumerate(getattr(optimizer, "param_groups", ())):
        rate = group.get("lr")
        if isinstance(rate, torch.Tensor) and rate.numel() == 1:
            rate = float(rate)  # once per check (construction, fit start): not per batch
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and (
                rate < 0 or not math.isfinite(rate)):
            raise ConfigurationError(
                f"The optimizer's param group {index} has the learning rate {rate!r}{when}: a "
                "negative (or non-finite) rate moves the weights up the gradient, so the loss "
                "would grow. Give a rate > 0, e.g. torch.optim.AdamW(model.parameters(), "
                "lr=3e-4), or set optimizer.param_groups[i]['lr'] to one (lr_find suggests "
                "one); to leave a part of the model as it is, freeze it "
                "(parameter.requires_grad_(False)) or give its group lr=0.")


def _function_name(function: Any) -> str:
    """How a user wrote the function: ``presets.standard``, ``make_callbacks``."""
    module = getattr(function, "__module__", "") or ""
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"presets.{name}" if module == "hookloop.presets" else name


def _check_callback_list(callbacks: Any) -> None:
    """``Loop(callbacks=...)``: a list (or other iterable) of `Callback` instances."""
    if callbacks is None:
        raise ConfigurationError(
            "callbacks is None: pass a list of callbacks (callbacks=[AMP(), Checkpoint(...)]) "
            "or leave the argument out for none.")
    if isinstance(callbacks, Callback):
        raise ConfigurationError("callbacks must be a list of callbacks: callbacks=[...].")
    if inspect.isfunction(callbacks) or inspect.ismethod(callbacks):
        name = _function_name(callbacks)
        raise ConfigurationError(
            f"callbacks is the function {name}, not a list: call it, callbacks={name}(...) "
            "(a preset is a function that returns the list of callbacks).")
    if isinstance(callbacks, (str, bytes, dict)) or not isinstance(callbacks, Iterable):
        raise ConfigurationError(
            f"callbacks must be a list of Callback instances, got {type(callbacks).__name__}.")
    if isinstance(callbacks, (list, tuple)):
        for index, callback in enumerate(callbacks):
            if isinstance(callback, type) and issubclass(callback, Callback):
                raise ConfigurationError(
                    f"callbacks[{index}] is the class {callback.__name__}, not an instance: "
                    f"write {callback.__name__}(...) in the list.")
            if inspect.isfunction(callback) or inspect.ismethod(callback):
                name = _function_name(callback)
                raise ConfigurationError(
                    f"callbacks[{index}] is the function {name}, not a callback: call it. A "
                    f"function returning a list of callbacks (a preset) goes in as "
                    f"callbacks={name}(...), or joined to others: [*{name}(...), MyCallback()].")
            if not isinstance(callback, Callback):
                raise ConfigurationError(
                    f"callbacks[{index}] is {callback!r} ({type(callback).__name__}), not a "
                    "hookloop.Callback. Subclass hookloop.Callback and pass an instance.")


def check_loop_arguments(model: Any, optimizer: Any, train_data: Any, val_data: Any,
                         loss_fn: Any, forward: Any, callbacks: Any, device: Any, *,
                         val_every_n_epochs: Any = 1, val_every_n_steps: Any = None,
                         sanity_val_batches: Any = 2, inputs: Any = None,
                         targets: Any = None, val_at_start: Any = False) -> torch.device:
    """Check `Loop`'s arguments when it is built; return the device to train on.

    Checks: a ``nn.Module`` model; an optimizer with at least one of the model's
    parameters; ``train_data`` (and ``val_data`` when given) iterable batches, not None,
    not a torch ``Dataset`` (it yields single samples: wrap it in a DataLoader), not a
    list of samples (its first item's targets without a batch dimension);
    ``loss_fn`` and ``forward`` callables (not classes) or None; ``callbacks`` a list of
    `Callback` instances (not None, not one callback); a device that exists here.

    Returns:
        The resolved device (see `resolve_device`).

    Raises:
        ConfigurationError: naming the argument, the problem and the fix.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> check_loop_arguments(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                      [(torch.ones(1, 2), torch.ones(1, 1))], None,
        ...                      torch.nn.functional.mse_loss, None, [], "cpu")
        device(type='cpu')
    """
    if not isinstance(model, nn.Module):
        raise ConfigurationError(
            f"model must be a torch.nn.Module, got {type(model).__name__}.")
    _check_optimizer(model, optimizer)
    _check_data(train_data, "train_data")
    if val_data is not None:
        _check_data(val_data, "val_data")
    if forward is None:  # a forward of its own may take single samples on purpose
        _check_samples(train_data, "train_data")
        if val_data is not None:
            _check_samples(val_data, "val_data")
    _check_callable(loss_fn, "loss_fn", "fn(outputs, targets) -> scalar loss")
    _check_arity(loss_fn, "loss_fn", 2, "loss_fn(outputs, targets)",
                 "For a loss that needs only the outputs, or more than the targets, pass "
                 "forward=fn(loop, batch) -> (outputs, loss) instead.")
    _check_arity(forward, "forward", 2, "forward(loop, batch)",
                 "It must return (outputs, loss).")
    _check_callable(forward, "forward", "fn(loop, batch) -> (outputs, loss)")
    _check_callback_list(callbacks)
    for label, selector in (("inputs", inputs), ("targets", targets)):
        _check_selector(label, selector)
    check_optional_int("Loop val_every_n_epochs", val_every_n_epochs)
    check_optional_int("Loop val_every_n_steps", val_every_n_steps)
    check_int("Loop sanity_val_batches", sanity_val_batches, minimum=0,
              hint="(0 turns the check off.)")
    if check_flag("Loop val_at_start", val_at_start) and val_data is None:
        raise ConfigurationError("Loop(val_at_start=True) validates before the first training "
                                 "step, but there is no val_data: pass val_data=loader, or "
                                 "leave val_at_start out.")
    return resolve_device(device)


def _one_shot(data: Any) -> bool:
    """True for an iterator (a generator...): iterating it a second time yields nothing."""
    return isinstance(data, Iterator)


def check_fit_data(train_data: Any, epochs_left: int, val_data: Any = None) -> None:
    """At ``fit`` start: refuse one-shot data that would run dry after the first epoch.

    A generator (any iterator: ``iter(x) is x``) is used up by one pass; with more than one
    epoch left, the second epoch would find it empty. Validation runs every epoch, so a
    one-shot ``val_data`` is refused likewise.

    Args:
        train_data: The loop's training data.
        epochs_left: Epochs this fit still runs (a resumed run counts what is left; an
            epoch cut short by ``stop()`` and continued counts as one).
        val_data: The loop's validation data, or None.

    Raises:
        ConfigurationError: naming the argument and the fix.

    Example:
        >>> check_fit_data([1, 2], epochs_left=3)          # a list can be iterated again
        >>> check_fit_data((b for b in [1, 2]), epochs_left=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: train_data is a generator, a one-shot iterator: ...
    """
    for data, name in ((train_data, "train_data"), (val_data, "val_data")):
        if data is not None and _one_shot(data) and epochs_left > 1:
            raise ConfigurationError(
                f"{name} is {with_article(type(data).__name__)}, a one-shot iterator: it is used "
                f"up after one pass, but this fit runs {epochs_left} more epochs, and the next "
                f"would find it empty. Pass something that can be iterated again: a list, a "
                "DataLoader, or an object whose __iter__ returns a new generator "
                "(class Batches: def __iter__(self): yield from make_batches()).")


def check_fit(epochs: Any, max_steps: Any, min_epochs: Any, min_steps: Any,
              callbacks: Sequence[object], host: object, train_data: Any, val_data: Any,
              epoch: int, optimizer: Any = None) -> None:
    """At ``fit``: its arguments (`check_fit_arguments`), the callback stack
    (`hookloop.engine.ordering.check_callbacks`, with ``host``, the loop, for the callbacks'
    ``produces``), one-shot data for the epochs left after ``epoch`` (`check_fit_data`),
    and the ``optimizer``'s learning rates as they are now (`check_learning_rates`:
    ``param_groups`` may have been edited since the loop was built). The first batch is
    checked against the loop's ``loss_fn``, ``forward`` and ``inputs=`` when it arrives,
    before anything sees it (`hookloop.engine.position.EpochPass`): reading a sample here
    would load one more than the training does, and on a resume one it trained on already."""
    check_fit_arguments(epochs, max_steps, min_epochs, min_steps)
    check_learning_rates(optimizer, " at fit start")
    check_callbacks(callbacks, host, val_data)  # a stack that cannot work: nothing ran yet
    check_fit_data(train_data, epochs - epoch, val_data)


def check_fit_arguments(epochs: Any, max_steps: Any, min_epochs: Any = None,
                        min_steps: Any = None) -> None:
    """``fit``'s own arguments: ``epochs`` an int >= 0, ``max_steps`` None or an int >= 1,
    ``min_epochs`` None or an int from 1 to ``epochs``, ``min_steps`` None or an int >= 1
    and not above ``max_steps``.

    Bools are refused (``max_steps=True`` would silently mean one step).

    Raises:
        ConfigurationError: naming the argument.

    Example:
        >>> check_fit_arguments(3, None)
        >>> check_fit_arguments(3, True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: max_steps must be a positive int or None, got True...
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ConfigurationError(
            f"epochs must be a non-negative int (the total number of epochs of the run), got "
            f"{epochs!r}.")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)
                                  or max_steps < 1):
        raise ConfigurationError(
            f"max_steps must be a positive int or None, got {max_steps!r} "
            f"({type(max_steps).__name__}).")
    check_optional_int("fit min_epochs", min_epochs)
    check_optional_int("fit min_steps", min_steps)
    if min_epochs is not None and min_epochs > epochs:
        raise ConfigurationError(
            f"fit min_epochs={min_epochs} is more than epochs={epochs}: training could never "
            f"reach it. Pass epochs >= {min_epochs}, or a smaller min_epochs.")
    if min_steps is not None and max_steps is not None and min_steps > max_steps:
        raise ConfigurationError(
            f"fit min_steps={min_steps} is more than max_steps={max_steps}: training could "
            f"never reach it. Pass max_steps >= {min_steps}, or a smaller min_steps.")


def check_evaluation(data: Any, prefix: Any) -> None:
    """`Loop.evaluate`'s arguments: some data, and a prefix that makes metric names."""
    if not isinstance(prefix, str) or not prefix.isidentifier():
        raise ConfigurationError(f"prefix must be a name such as 'test', got {prefix!r}.")
    if data is None:
        raise ConfigurationError("evaluate() needs data to evaluate, got None.")


def check_setup(accumulation_steps: Any, train_data: Any, val_data: Any) -> None:
    """After every ``setup`` hook ran (DDP may have rebuilt the data): the step geometry and
    the data are usable.

    Raises:
        ConfigurationError: ``accumulation_steps`` set to something else than an int >= 1,
            empty training data, or empty validation data in a single process (under DDP
            one rank's shard may be empty; the validation pass checks the total).
    """
    check_int("Loop accumulation_steps (set by a callback's setup)", accumulation_steps)
    if length_of(train_data) == 0:
        raise ConfigurationError(
            "train_data is empty (len(train_data) == 0): check the dataset, the batch size "
            "and drop_last.")
    if val_data is not None and length_of(val_data) == 0 and distributed.world_size() == 1:
        raise ConfigurationError("val_data is empty (len(val_data) == 0): pass val_data=None "
                                 "to train without validation, or check the dataset.")
