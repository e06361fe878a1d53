"""How the loop gets outputs and loss from a batch: the rules of the SPEC, and prediction.

The rules, first that applies: ``forward(loop, batch)`` when given; the ``inputs=``
(and ``targets=``) rule of the loop, for mapping batches: ``loss_fn(model(inputs),
targets)``; an ``(inputs, targets)`` pair with ``loss_fn``; a mapping batch:
``model(**batch)`` returning its loss; otherwise a clear error.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hookloop.engine.data import find_targets, is_pair, move_to_device
from hookloop.errors import ConfigurationError, with_article

if TYPE_CHECKING:
    from hookloop.engine.dispatch import Table

__all__ = ["ForwardRule", "new_rule", "check_loss", "plain_loss", "concatenate", "model_inputs",
           "select", "check_batch_rule", "Selector", "input_problem", "target_problem",
           "predict_dtype"]

#: How ``Loop(inputs=..., targets=...)`` names a part of a batch: a key (or an index of a
#: tuple batch), or a function of the batch.
Selector = str | int | Callable[[Any], Any]


def select(selector: Selector, batch: Any, what: str) -> Any:
    """The part of ``batch`` a rule names: ``batch[key]``, or ``selector(batch)``.

    Example:
        >>> select("image", {"image": 1, "label": 2}, "inputs")
        1
        >>> select("pixels", {"image": 1, "label": 2}, "inputs")
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: Loop inputs='pixels': the batch has no such key; its keys are 'image', 'label'.
    """
    if callable(selector):
        return selector(batch)
    try:
        return batch[selector]
    except (KeyError, IndexError, TypeError):
        found = (f"its keys are {', '.join(repr(key) for key in batch)}"
                 if isinstance(batch, Mapping) else f"it is {with_article(type(batch).__name__)}")
        raise ConfigurationError(f"Loop {what}={selector!r}: the batch has no such key; "
                                 f"{found}.") from None


def check_batch_rule(batch: Any, *, loss_fn: Any, forward: Any, inputs: Any) -> None:
    """A mapping batch (or sample) with a ``loss_fn`` needs the ``inputs=`` rule: without
    it, this raises the error that names the batch's keys and the fix (before the model is
    called with arguments it does not take)."""
    if isinstance(batch, Mapping) and loss_fn is not None and forward is None \
            and inputs is None:
        keys = ", ".join(repr(key) for key in batch)
        raise ConfigurationError(
            f"The batch is a mapping (keys {keys}) and the Loop has a loss_fn, so it trains "
            "pair-style, but nothing says which entry is the model's input: pass "
            "Loop(..., inputs='<key>', targets='<key>') (key names or functions of the "
            "batch), or forward=fn(loop, batch) -> (outputs, loss). Without loss_fn, a "
            "mapping batch is given to the model as model(**batch), which must return its "
            "loss.")


def _loss_of(outputs: Any, called: str) -> torch.Tensor:
    """``outputs["loss"]`` or ``outputs.loss`` of a model that returns its loss; ``called``
    says how the model was called, for the error."""
    if isinstance(outputs, Mapping) and outputs.get("loss") is not None:
        return outputs["loss"]
    if not isinstance(outputs, Mapping) and getattr(outputs, "loss", None) is not None:
        return outputs.loss
    keys = f" (keys: {', '.join(map(str, outputs))})" if isinstance(outputs, Mapping) else ""
    raise ConfigurationError(
        f"The model was called as {called}, but its output, "
        f"{with_article(type(outputs).__name__)}{keys}, has no 'loss', and the Loop has no "
        "loss_fn. Return the loss from the model "
        "(outputs['loss'] or outputs.loss), pass loss_fn=fn(outputs, targets) (with "
        "inputs=/targets= for mapping batches), or pass forward=fn(loop, batch) -> "
        "(outputs, loss) to the Loop.")


#: Failures that say nothing about the batch (a full device, a broken process group): raised
#: as they are, whatever the inputs look like (code that catches them must still see them).
_NOT_THE_BATCH: tuple[type[BaseException], ...] = tuple(
    kind for kind in (torch.cuda.OutOfMemoryError, getattr(torch.distributed, "DistError", None))
    if isinstance(kind, type))


def _call(model: Any, call: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
    args, kwargs = call
    try:
        return model(*args, **kwargs)
    except _NOT_THE_BATCH:
        raise
    except (RuntimeError, TypeError) as error:  # torch's "mat1 and mat2", "must be Tensor"
        _raise_input_problem(model, args, kwargs, error)
        raise


def _raise_input_problem(model: Any, args: Any, kwargs: Any, error: BaseException) -> None:
    """A `ConfigurationError` naming what in the inputs the model could not run on, when
    that is known (else the caller raises ``error`` as it is)."""
    problem = input_problem(model, args, kwargs)
    if problem is not None:
        raise ConfigurationError(f"The model could not run on the batch: {problem}") from error


def _loss(loss_fn: Any, outputs: Any, targets: Any) -> Any:
    """``loss_fn(outputs, targets)``; when it raises on targets of the wrong kind, the error
    says which kind it wants (torch's "expected target dtype to be Long" does not)."""
    try:
        return loss_fn(outputs, targets)
    except _NOT_THE_BATCH:
        raise
    except (RuntimeError, TypeError, ValueError) as error:
        _raise_target_problem(outputs, targets, error)
        raise


def _raise_target_problem(outputs: Any, targets: Any, error: BaseException) -> None:
    """A `ConfigurationError` saying which targets ``loss_fn`` wants, when that is known
    (else the caller raises ``error`` as it is)."""
    problem = target_problem(outputs, targets)
    if problem is not None:
        raise ConfigurationError(f"loss_fn(outputs, targets) failed: {problem}") from error


def target_problem(outputs: Any, targets: Any) -> str | None:
    """Why a classification loss may have refused ``targets``, with the fix; None when they
    look right. Asked only after the loss raised.

    Floating targets with one dimension less than the outputs are class indices stored as
    floats (``cross_entropy`` and ``nll_loss`` take int64 indices, or floating class
    probabilities of the outputs' shape).

    Example:
        >>> print(target_problem(torch.zeros(4, 3), torch.zeros(4)))  # doctest: +ELLIPSIS
        the targets are torch.float32 of shape (4,), class indices for outputs of shape (4, 3)...
    """
    if not (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return None
    if targets.is_floating_point() and outputs.dim() == targets.dim() + 1 and \
            outputs.shape[:1] == targets.shape[:1]:
        return (f"the targets are {targets.dtype} of shape {tuple(targets.shape)}, class indices "
                f"for outputs of shape {tuple(outputs.shape)}, but a cross-entropy loss "
                "(cross_entropy, nll_loss, nn.CrossEntropyLoss) takes class indices as "
                "integers: convert them, targets.long() (in the dataset, or "
                "torch.tensor(labels, dtype=torch.long)); floating targets must be class "
                f"probabilities of the outputs' shape {tuple(outputs.shape)}.")
    return None


def _floating_dtype(model: Any) -> torch.dtype | None:
    parameters = model.parameters() if callable(getattr(model, "parameters", None)) else ()
    return next((p.dtype for p in parameters if p.is_floating_point()), None)


def input_problem(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    """Why the model's inputs may have made it fail, with the fix; None when they look right.

    Asked only after the model raised (a model that converts its inputs itself is never
    refused): a numpy array or a list of numbers where a tensor belongs, or a floating
    tensor of another dtype than the model's parameters (float64 data, a float32 model).

    Example:
        >>> import numpy
        >>> input_problem(torch.nn.Linear(2, 1), (numpy.zeros((1, 2)),), {})  # doctest: +ELLIPSIS
        'the input is a numpy.ndarray (float64), not a tensor: ... torch.from_numpy(array).float()...'
        >>> input_problem(torch.nn.Linear(2, 1), (torch.zeros(1, 2),), {}) is None
        True
    """
    expected = _floating_dtype(model)
    for name, value in [*((f"input {index}" if len(args) > 1 else "input", item)
                          for index, item in enumerate(args)),
                        *((f"input {key!r}", item) for key, item in kwargs.items())]:
        kind = type(value)
        if kind.__module__ == "numpy" and hasattr(value, "dtype"):
            return (f"the {name} is a numpy.{kind.__name__} ({value.dtype}), not a tensor: the "
                    "model takes tensors. Convert it, torch.from_numpy(array).float() (float32, "
                    "the dtype of most models), or batch the data with a "
                    "torch.utils.data.DataLoader, whose collate makes tensors.")
        if isinstance(value, (list, tuple)) and value and all(
                isinstance(item, (int, float)) for item in value):
            return (f"the {name} is {with_article(kind.__name__)} of numbers, not a tensor: "
                    "the model takes tensors. Convert it, torch.tensor(values, dtype=torch.float32), or batch "
                    "the data with a torch.utils.data.DataLoader, whose collate makes tensors.")
        if isinstance(value, torch.Tensor) and value.is_floating_point() and \
                expected is not None and value.dtype != expected:
            return (f"the {name} is {value.dtype} but the model's parameters are {expected}. "
                    f"Convert the data to the model's dtype, inputs.to({expected}) (a numpy "
                    f"array: torch.from_numpy(array).to({expected})), or the model to the "
                    f"data's, model.to({value.dtype}).")
    return None


class ForwardRule(NamedTuple):
    """How the loop gets outputs and loss from a batch, built from the loop's arguments
    when a fit (or a pass outside it) sets up.

    ``host`` is what a ``forward=`` function is called with (the loop, held as it is); the
    model is passed at each call, since callbacks swap it inside their contexts (DDP's
    validation, `hookloop.callbacks.Compile`).
    """

    host: object
    forward: Callable[..., Any] | None
    loss_fn: Callable[[Any, Any], Any] | None
    inputs: Selector | None
    targets: Selector | None

    def targets_of(self, batch: Any) -> Any:
        """The targets of ``batch``: the ``targets=`` rule, else item 1 of a pair or the
        ``labels``/``targets`` entry of a mapping (None when there are none)."""
        if self.targets is not None:
            return select(self.targets, batch, "targets")
        return find_targets(batch)

    def check_batch(self, batch: Any) -> None:
        """`check_batch_rule` for this rule."""
        check_batch_rule(batch, loss_fn=self.loss_fn, forward=self.forward, inputs=self.inputs)

    def compute(self, model: Any, batch: Any) -> tuple[Any, torch.Tensor]:
        """Outputs and loss of one batch, by the first rule that applies.

        1. ``forward(loop, batch) -> (outputs, loss)`` when given.
        2. ``inputs`` (``Loop(inputs=...)``): ``outputs = model(inputs)``, then
           ``loss_fn(outputs, targets)`` (targets by ``targets``, else the batch's
           ``labels``/``targets``), or the model's own loss without a ``loss_fn``.
        3. An ``(inputs, targets)`` pair with ``loss_fn``: ``loss_fn(model(inputs), targets)``.
        4. A mapping without ``loss_fn``: ``outputs = model(**batch)`` and ``outputs["loss"]``
           or ``outputs.loss``. A mapping with a ``loss_fn`` but no ``inputs`` rule is an
           error naming the batch's keys and the fix, before the model is called.
        5. Otherwise a `ConfigurationError` saying which to use.
        """
        if self.forward is not None:
            result = self.forward(self.host, batch)
            if not isinstance(result, tuple) or len(result) != 2:
                raise ConfigurationError(
                    f"forward(loop, batch) must return (outputs, loss); it returned "
                    f"{type(result).__name__}.")
            return result
        loss_fn = self.loss_fn
        if self.inputs is not None:
            call = model_inputs(batch, self.inputs)
            assert call is not None
            outputs = _call(model, call)
            if loss_fn is None:
                return outputs, _loss_of(outputs, f"model(inputs) (inputs={self.inputs!r})")
            return outputs, _loss(loss_fn, outputs, self.targets_of(batch))
        kind = type(batch)
        if loss_fn is not None and (len(batch) == 2 if kind is tuple or kind is list
                                    else is_pair(batch)):
            # The usual batch: the model and the loss called here, no helper frame each
            # (the errors of `_call` and `_loss`).
            inputs = batch[0]
            try:
                outputs = model(inputs)
            except _NOT_THE_BATCH:
                raise
            except (RuntimeError, TypeError) as error:
                _raise_input_problem(model, (inputs,), {}, error)
                raise
            targets = batch[1] if self.targets is None else self.targets_of(batch)
            try:
                return outputs, loss_fn(outputs, targets)
            except _NOT_THE_BATCH:
                raise
            except (RuntimeError, TypeError, ValueError) as error:
                _raise_target_problem(outputs, targets, error)
                raise
        if isinstance(batch, Mapping):
            self.check_batch(batch)
            outputs = model(**batch)
            return outputs, _loss_of(outputs, "model(**batch) (the batch is a mapping)")
        if is_pair(batch):
            raise ConfigurationError(
                "The batch is an (inputs, targets) pair but the Loop has no loss_fn. Pass "
                "loss_fn=fn(outputs, targets) (e.g. torch.nn.functional.cross_entropy), or "
                "forward=fn(loop, batch) -> (outputs, loss).")
        raise ConfigurationError(
            f"Cannot compute a loss from a batch of type {type(batch).__name__}. Use one of: "
            "forward=fn(loop, batch) -> (outputs, loss); (inputs, targets) batches with "
            "loss_fn=fn(outputs, targets); or mapping batches with a model returning a 'loss'.")

    def predict(self, model: Any, batch: Any, forward: Any = None) -> Any:
        """What the model returns for ``batch``, without needing targets or a loss.

        The first that applies: ``forward(loop, batch)`` (given to `Loop.predict`); the
        ``inputs=`` rule: ``model(inputs)``; the loop's ``forward`` (its outputs); the inputs
        of a pair (or the first item of any tuple or list); ``model(**batch)`` for a
        mapping; ``model(batch)`` otherwise. A forward returning ``(outputs, loss)`` gives
        its outputs.
        """
        forward = forward if forward is not None else (None if self.inputs is not None
                                                       else self.forward)
        if forward is not None:
            result = forward(self.host, batch)
            return result[0] if isinstance(result, tuple) and len(result) == 2 else result
        call = model_inputs(batch, self.inputs)
        if call is None or (self.inputs is None and hasattr(batch, "_fields")):  # a namedtuple
            return _call(model, ((batch,), {}))
        return _call(model, call)

    def predict_all(self, state: Any, model: Any, device: Any, data: Iterable[Any],
                    table: Table, forward: Any = None,
                    dtype: torch.dtype | None = torch.float32) -> Any:
        """`predict` of every batch of ``data``, inside the ``forward_context`` hooks of
        ``table``, moved to the CPU (floating tensors as ``dtype``) and joined with
        `concatenate`. Each batch is ``state.batch`` during its forward (then the one
        before is put back). ``model()`` gives the model of the moment."""
        outputs: list[Any] = []
        cpu = torch.device("cpu")
        with state.kept("batch"):  # a predict inside fit leaves fit's batch as it was
            for batch in data:
                # The current batch, for the forward contexts (ThroughputMonitor counts it).
                state.batch = batch = move_to_device(batch, device)
                with table.entered(table.forward_context):
                    result = self.predict(model(), batch, forward)
                outputs.append(_cast(move_to_device(result, cpu), dtype))
        return concatenate(outputs)


#: ``new_rule((host, forward, loss_fn, inputs, targets))``: a `ForwardRule` built in C (the
#: loop builds one per use, twice a batch; calling the class runs a Python ``__new__``).
new_rule = functools.partial(tuple.__new__, ForwardRule)


def check_loss(loss: Any, training: bool, replaced: bool = False) -> torch.Tensor:
    """Raise unless ``loss`` is a scalar tensor (that requires grad, in training); return
    the loss the loop keeps (`plain_loss`: a DTensor's value as a plain tensor).

    Reads only metadata (type, shape, requires_grad): no device sync. ``replaced``: the
    loss is one a callback put in ``loop.state.loss`` in ``after_forward``.
    """
    what = "The loss a callback put in loop.state.loss in after_forward" if replaced else "The loss"
    if not isinstance(loss, torch.Tensor):
        raise ConfigurationError(f"{what} must be a scalar tensor, got {type(loss).__name__}.")
    if loss.dim() != 0:
        raise ConfigurationError(
            f"{what} must be a scalar tensor, but it has shape {tuple(loss.shape)}. "
            "Reduce it (loss.mean()) or use a loss function with reduction='mean'.")
    if training and not loss.requires_grad:
        raise ConfigurationError(
            f"{what} does not require grad, so backward cannot run: it was detached, "
            "computed under torch.no_grad(), or no trainable parameter took part in it.")
    return plain_loss(loss)


def plain_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: a DTensor's (tensor parallel's ``loss_parallel`` gives
    one) becomes its value, once, where the loop receives it, so everything that reads the
    loss (the epoch sums, ``state.loss``, loggers, checkpoints) gets a plain tensor.

    A replicated DTensor gives its local tensor (every rank holds the whole value: no
    communication, no device sync); another placement (a ``Partial`` sum) its
    ``full_tensor()``, a collective of the ranks that computed it together. Both keep the
    autograd graph: backward through the plain loss is the DTensor's backward (the gradient
    enters as the replicated one a DTensor's own ``backward()`` would seed).

    Example:
        >>> plain_loss(torch.tensor(0.5))
        tensor(0.5000)
    """
    if type(loss) is torch.Tensor:  # the usual loss: no lookup
        return loss
    # Only a process that imported torch's DTensor can hold one: no import here.
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(loss, module.DTensor):
        return loss
    if all(placement.is_replicate() for placement in loss.placements):
        return loss.to_local()
    return loss.full_tensor()


_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "half", "float", "double")


def predict_dtype(dtype: Any) -> torch.dtype | None:
    """`Loop.predict`'s ``dtype``: None, a floating ``torch.dtype``, or its name as a string
    (``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"``, with or without ``torch.``).

    An integer or bool dtype is refused: floating outputs cast to it would be truncated
    silently (take ``outputs.argmax(-1)`` for class indices).

    Example:
        >>> predict_dtype("float16")
        torch.float16
        >>> predict_dtype(torch.int64)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hookloop.errors.ConfigurationError: predict dtype must be a floating dtype ..., got torch.int64: ...
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        found = getattr(torch, name, None) if name in _DTYPE_NAMES else None
        if found is None:
            raise ConfigurationError(
                f"predict dtype {dtype!r} is not the name of a floating dtype: use one of "
                f"{', '.join(repr(name) for name in _DTYPE_NAMES[:4])} (or torch.float16..., "
                "or None to keep the dtypes the model computed). A device is the Loop's "
                "device=, not predict's dtype.")
        return found
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    why = ("floating outputs cast to it would be truncated to integers silently; for class "
           "indices take outputs.argmax(-1), and integer outputs are returned as they are"
           if isinstance(dtype, torch.dtype) else "it is not a dtype")
    raise ConfigurationError(
        f"predict dtype must be a floating dtype (torch.float32, torch.bfloat16, "
        f"torch.float16, torch.float64, or its name) or None, got {dtype!r}: {why}.")


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    """Floating tensors (nested in tuples, lists, dicts) as ``dtype``; None keeps them."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, Mapping):
        cast = {key: _cast(item, dtype) for key, item in value.items()}
        try:
            return cast if type(value) is dict else type(value)(cast)  # type: ignore[call-arg]
        except TypeError:
            return cast
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_cast(item, dtype) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(item, dtype) for item in value)
    return value


def concatenate(outputs: list[Any]) -> Any:
    """Per-batch outputs joined along the batch dimension where they are tensors.

    Tensors (with a batch dimension) are concatenated, also inside tuples, lists and
    mappings of the same structure in every batch; anything else stays a list of batches.

    Example:
        >>> concatenate([torch.zeros(2, 3), torch.ones(1, 3)]).shape
        torch.Size([3, 3])
        >>> {k: v.shape for k, v in concatenate([{"logits": torch.zeros(2, 4)}] * 2).items()}
        {'logits': torch.Size([4, 4])}
    """
    if not outputs:
        return []
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(item, torch.Tensor) and item.dim() > 0
               and item.shape[1:] == first.shape[1:] for item in outputs):
            return torch.cat(outputs)
        return outputs
    if isinstance(first, Mapping) and all(isinstance(item, Mapping) and item.keys() == first.keys()
                                          for item in outputs):
        return _joined_mappings(outputs, first)
    if isinstance(first, (tuple, list)) and all(
            isinstance(item, type(first)) and len(item) == len(first) for item in outputs):
        return _joined_sequences(outputs, first)
    return outputs


def _joined_mappings(outputs: list[Any], first: Mapping[Any, Any]) -> Any:
    """Mappings of the same keys, each entry `concatenate`d, in ``first``'s type if it can."""
    joined = {key: concatenate([item[key] for item in outputs]) for key in first}
    try:
        return type(first)(joined) if type(first) is not dict else joined  # type: ignore[call-arg]
    except TypeError:
        return joined


def _joined_sequences(outputs: list[Any], first: tuple[Any, ...] | list[Any]) -> Any:
    """Tuples (named ones too) or lists of the same length, each column `concatenate`d."""
    columns = [concatenate([item[index] for item in outputs]) for index in range(len(first))]
    if hasattr(first, "_fields"):
        return type(first)(*columns)
    return type(first)(columns)


def model_inputs(batch: Any, inputs: Selector | None = None
                 ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """What the loop's built-in rules pass to the model: ``(args, kwargs)``, or None.

    With the loop's ``inputs`` rule: the part it selects (a mapping gives keyword
    arguments, a tuple positional ones, anything else one argument). Without: an
    ``(inputs, targets)`` pair (or longer tuple/list) gives ``model(inputs)``; a mapping
    gives ``model(**batch)``; a lone tensor gives ``model(batch)``.

    Example:
        >>> import torch
        >>> args, kwargs = model_inputs((torch.zeros(2, 3), torch.zeros(2)))
        >>> args[0].shape, kwargs
        (torch.Size([2, 3]), {})
    """
    if inputs is not None:
        chosen = select(inputs, batch, "inputs")
        if isinstance(chosen, Mapping):
            return (), dict(chosen)
        return (tuple(chosen), {}) if type(chosen) is tuple else ((chosen,), {})
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)) and batch:
        return (batch[0],), {}
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    return None
