"""`Metrics`: sample-weighted validation (and training) metrics, accumulated on the device."""

from __future__ import annotations

import copy
import numbers
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from hookloop import distributed
from hookloop.base.checks import check_flag, check_name
from hookloop.callback import Callback
from hookloop.errors import ConfigurationError, with_article

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["Metrics"]


def _is_stateful_metric(metric: Any) -> bool:
    return all(callable(getattr(metric, method, None)) for method in ("update", "compute", "reset"))


def synchronises_itself(metric: Any) -> bool:
    """True for an update/compute object that reduces its state across ranks by itself.

    torchmetrics' ``Metric`` has a ``sync()`` method and the ``dist_sync_on_step`` and
    ``_to_sync`` attributes; an object with any of them is taken to synchronise.
    """
    return (callable(getattr(metric, "sync", None)) or hasattr(metric, "dist_sync_on_step")
            or hasattr(metric, "_to_sync"))


_TARGET_LIKE = re.compile(r"^(y|gt)$|label|target|class|answer|categor|score|rating", re.I)


def _targets_key(batch: Mapping[Any, Any]) -> Any:
    """The key of ``batch`` that most likely holds the targets (for the error's example)."""
    keys = list(batch)
    return next((key for key in keys if _TARGET_LIKE.search(str(key))), keys[-1])


def _missing_targets(metrics: Metrics, error: Exception, batch: Any, outputs: Any) -> str:
    """The error of a metric that failed on a batch without targets: the batch's real keys
    and both places to say where the targets are (the loop's rule, or these metrics')."""
    rule: str | None
    function: str | None
    if isinstance(batch, Mapping) and batch:
        key = _targets_key(batch)
        what = (f"{with_article(type(batch).__name__)} with the keys "
                f"{', '.join(repr(name) for name in batch)}")
        rule, function = f"targets={key!r}", f"lambda batch: batch[{key!r}]"
    elif isinstance(batch, (tuple, list)) and batch:
        what = f"{with_article(type(batch).__name__)} of {len(batch)} item(s)"
        function = f"lambda batch: batch[{len(batch) - 1}]"
        rule = f"targets={function}"
    else:
        what = with_article(type(batch).__name__)
        rule = function = None
    if isinstance(outputs, Mapping):
        pick = next((name for name in outputs if str(name) == "logits"), next(iter(outputs), 0))
        shape = f"lambda outputs: outputs[{pick!r}]"
    elif hasattr(outputs, "logits"):
        shape = "lambda outputs: outputs.logits"
    else:
        shape = "fn(outputs) -> what the metric takes"
    where = (f"Say where they are: Loop(..., {rule}) for the whole loop (the loss, Metrics and "
             f"predict), or Metrics(..., targets={function}) for these metrics only. "
             if rule is not None else
             "This batch holds no targets to point at: give the loop batches that hold them "
             "(an (inputs, targets) pair, or a mapping with a 'labels' key), or a forward= that "
             "returns them with the outputs. ")
    return (f"{metrics!r}: a metric failed with {type(error).__name__}: {error}, and the batch, "
            f"{what}, has no targets the loop could find: it finds them only as the second "
            "item of an (inputs, targets) pair or under a 'labels'/'targets' key, so the "
            f"metrics got targets=None. {where}If the metric needs something other than the "
            f"model's outputs ({with_article(type(outputs).__name__)}), also pass "
            f"Metrics(..., outputs={shape}).")


class _Pass:
    """Accumulators of one pass (training or validation) on the device."""

    def __init__(self, functions: dict[str, Callable[[Any, Any], Any]],
                 objects: dict[str, Any]) -> None:
        self.functions = functions
        self.objects = objects
        self.sums: dict[str, torch.Tensor] = {}
        self.samples = 0
        self.device = torch.device("cpu")

    def reset(self, device: torch.device) -> None:
        dtype = torch.float32 if device.type == "mps" else torch.float64
        self.sums = {name: torch.zeros((), dtype=dtype, device=device) for name in self.functions}
        self.samples = 0
        self.device = device
        for metric in self.objects.values():
            metric.reset()

    def update(self, outputs: Any, targets: Any, batch_size: int) -> None:
        with torch.no_grad():
            for name, function in self.functions.items():
                value = function(outputs, targets)
                accumulator = self.sums[name]
                if not isinstance(value, (torch.Tensor, numbers.Real)):
                    raise ConfigurationError(
                        f"Metric {name!r} ({getattr(function, '__name__', function)!r}) returned "
                        f"{value!r} ({type(value).__name__}); a metric function must return the "
                        "batch mean as a number or a scalar tensor, e.g. "
                        "(outputs.argmax(-1) == targets).float().mean().")
                value = torch.as_tensor(value).detach()
                if value.numel() != 1:
                    raise ConfigurationError(
                        f"Metric {name!r} returned a tensor of shape {tuple(value.shape)}; a metric "
                        "function must return the batch mean as a scalar (e.g. .float().mean()).")
                value = value.reshape(()).to(device=accumulator.device, dtype=accumulator.dtype)
                self.sums[name] = torch.add(accumulator, value, alpha=batch_size)
            for metric in self.objects.values():
                metric.update(outputs, targets)
        self.samples += batch_size

    def results(self, prefix: str, where: str) -> dict[str, float]:
        """Reduce over ranks (one collective, one host sync) and return the floats.

        A collective: every rank calls it at the end of every pass, also a rank whose shard
        held no batch (its sums are zeros). The division comes after the reduction, so the
        values, and which metrics are written, are the same on every rank. A pass with no
        sample on any rank writes nothing.
        """
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        local = torch.stack([*self.sums.values(),
                             torch.tensor(float(self.samples), dtype=dtype, device=self.device)])
        totals = distributed.data_parallel_sum(local).tolist()
        count = totals[-1]
        if not count:
            return {}
        values = {prefix + name: total / count for name, total in zip(self.sums, totals)}
        for name, metric in self.objects.items():
            try:
                value = metric.compute()
            except Exception as error:
                if self.samples:
                    raise
                raise ConfigurationError(
                    f"Metric {name!r}: compute() raised {type(error).__name__}: {error} on rank "
                    f"{distributed.rank()}, whose shard of the {where} data held no batch (the "
                    f"ranks saw {int(count)} samples in all). Under DDP compute() runs on every "
                    "rank, so that metrics which synchronise inside compute() (torchmetrics "
                    "objects) do not hang: make compute() work before any update(), or pass "
                    "a function fn(outputs, targets), which Metrics reduces over the ranks "
                    "itself.") from error
            values[prefix + name] = float(torch.as_tensor(value).detach().cpu().item())
        return values


class Metrics(Callback):
    """Compute metrics over the validation set (and, on request, the training set).

    A metric is either a function ``fn(outputs, targets)`` returning the mean over the batch
    (a scalar tensor or a float), or an object with ``update(outputs, targets)``,
    ``compute()`` and ``reset()`` (torchmetrics style; torchmetrics is not required).

    Function metrics are averaged over samples: each batch mean is weighted by
    ``loop.state.batch_size``, summed on the device (no host sync per batch), reduced over
    ranks with one all-reduce and read once per pass. Under DDP with the samplers of the
    ``DDP`` callback the value equals the single-process value. Every rank takes part in
    that reduction at the end of every pass, also a rank whose shard held no batch (an
    uneven validation set), and divides only after it, so every rank writes the same
    values; a pass that saw no sample on any rank writes no value. Object metrics are
    reset at the start of each pass and their ``compute()`` is read once at its end, on
    every rank (torchmetrics objects synchronise across ranks inside ``compute()``). An
    object that does not synchronise itself (no ``sync()``, ``dist_sync_on_step`` or
    ``_to_sync``, as torchmetrics objects have) reports its own rank's shard only: under
    DDP that is said once, in a warning, at the first validation.

    The values are written into ``loop.state.metrics`` as floats: ``val_<name>`` at
    ``on_validation_end`` (``<prefix>_<name>`` in `Loop.evaluate`, e.g. ``test_acc``) and, with ``on_train=True``, ``train_<name>`` when the training
    pass ends (at ``on_validation_start``, or ``on_epoch_end`` without validation data),
    before the callbacks after this one read them. Put ``Metrics`` before the callbacks
    that monitor its metrics (checked at fit start).

    The training sums of function metrics are checkpointed at every step boundary, so a
    single-process run resumed mid-epoch reports the same ``train_<name>`` as an
    uninterrupted one (under DDP, and for object metrics, the resumed epoch's training
    value covers the batches after the resume). The state is stored under
    ``Metrics(<names>)`` (or ``name``).

    What a metric receives: by default the model's outputs and the batch's targets (the
    second item of a pair, or the ``labels``/``targets`` entry of a mapping). ``targets=``
    and ``outputs=`` change that, e.g. for a dataset yielding ``{"image", "label"}`` and a
    model returning an object with ``.logits`` (Hugging Face style). A batch without
    targets is an error at the first batch that names the fix.

    Args:
        on_train: Also compute each metric over the training batches (``train_<name>``),
            from the outputs of the training forward pass (dropout on).
        name: State key in checkpoints (for two ``Metrics`` in one stack).
        targets: ``fn(batch) -> targets``, e.g. ``lambda batch: batch["label"]``.
        outputs: ``fn(outputs) -> what metrics receive``, e.g. ``lambda out: out.logits``.
        **metrics: ``name=metric`` pairs.

    Raises:
        ConfigurationError: no metric, or a metric that is neither callable nor an object
            with ``update``/``compute``/``reset``; under DDP, an object whose ``compute()``
            fails on a rank that saw no batch of the pass.

    Example:
        >>> import torch
        >>> from hookloop.callbacks import Metrics
        >>> def accuracy(outputs, targets):
        ...     return (outputs.argmax(dim=-1) == targets).float().mean()
        >>> metrics = Metrics(acc=accuracy)
        >>> sorted(metrics.produces(None))
        ['val_acc']
    """

    state_at_boundaries = True  # it keeps the training sums of the boundary itself

    def __init__(self, *, on_train: bool = False, name: str | None = None,
                 targets: Callable[[Any], Any] | None = None,
                 outputs: Callable[[Any], Any] | None = None, **metrics: Any) -> None:
        if not metrics:
            raise ConfigurationError(
                "Metrics metrics must be at least one name=metric pair, e.g. "
                "Metrics(acc=accuracy), got none.")
        check_flag("Metrics on_train", on_train)
        check_name("Metrics name", name)
        examples = {"targets": "fn(batch) -> targets, e.g. lambda batch: batch['label']",
                    "outputs": "fn(outputs) -> what metrics receive, e.g. lambda out: out.logits"}
        for label, function in (("targets", targets), ("outputs", outputs)):
            if function is not None and not callable(function):
                raise ConfigurationError(
                    f"Metrics {label} must be a function {examples[label]}, or None, got "
                    f"{function!r}.")
        functions: dict[str, Callable[[Any, Any], Any]] = {}
        objects: dict[str, Any] = {}
        for metric_name, metric in metrics.items():
            if _is_stateful_metric(metric):
                objects[metric_name] = metric
            elif callable(metric):
                functions[metric_name] = metric
            else:
                raise ConfigurationError(
                    f"Metrics {metric_name} must be a function fn(outputs, targets) -> batch "
                    "mean, or an object with update(outputs, targets), compute() and reset(), "
                    f"got {metric!r}.")
        self.on_train = on_train
        self.name = name
        self.metrics = dict(metrics)
        self.targets = targets
        self.outputs = outputs
        self._validation = _Pass(functions, objects)
        # Objects keep their own state: the training pass needs separate instances.
        self._training = _Pass(dict(functions), {key: copy.deepcopy(value)
                                                 for key, value in objects.items()})
        self._loop: Loop | None = None
        self._train_pending = False
        self._warned_unsynced = False
        # Training sums at the last step boundaries, keyed by the loop position (epoch,
        # batches done) they belong to: see state_dict. A loaded state adds its own.
        self._boundaries: dict[tuple[int, int], tuple[dict[str, torch.Tensor], int]] = {}

    @property
    def state_key(self) -> str:
        """``name`` when set, else ``Metrics(<metric names>)``: two stacks of metrics differ."""
        return self.name or f"Metrics({','.join(self.metrics)})"

    def __repr__(self) -> str:
        return f"Metrics({', '.join(self.metrics)}{', on_train=True' if self.on_train else ''})"

    def produces(self, loop: Loop | None) -> Iterable[str]:
        """``val_<name>`` for each metric, and ``train_<name>`` with ``on_train``."""
        names = [f"val_{name}" for name in self.metrics]
        if self.on_train:
            names += [f"train_{name}" for name in self.metrics]
        return names

    # ---------------------------------------------------------------- training
    def setup(self, loop: Loop) -> None:
        self._loop = loop

    def on_epoch_start(self, loop: Loop) -> None:
        if not self.on_train:
            return
        self._training.reset(loop.device)
        epoch, done, _ = loop.position
        saved = self._boundaries.get((epoch, done)) if done and epoch == loop.state.epoch else None
        self._boundaries.clear()
        if saved is not None:  # the epoch continues (a resume, or fit() after an exception)
            sums, samples = saved
            self._training.sums = {key: value.to(loop.device) for key, value in sums.items()}
            self._training.samples = samples
            self._boundaries[(epoch, done)] = (dict(self._training.sums), samples)
        self._train_pending = True

    def _update(self, metrics: _Pass, loop: Loop) -> None:
        """Feed the current batch to ``metrics``; a failure without targets says where to
        find them (a metric such as in-batch retrieval may need none, so None is passed)."""
        state = loop.state
        outputs = state.outputs if self.outputs is None else self.outputs(state.outputs)
        targets = state.targets if self.targets is None else self.targets(state.batch)
        try:
            metrics.update(outputs, targets, state.batch_size)
        except ConfigurationError:
            raise
        except Exception as error:
            if targets is not None:
                raise
            raise ConfigurationError(_missing_targets(self, error, state.batch,
                                                      state.outputs)) from error

    def after_forward(self, loop: Loop) -> None:
        if not self.on_train:
            return
        state = loop.state
        self._update(self._training, loop)
        if state.step_boundary:  # the boundary as known now: a callback may still move it
            self._snapshot(loop)

    def on_batch_end(self, loop: Loop) -> None:
        # A boundary a callback drew after this batch's forward (in after_backward): the
        # loop has recorded its position at this batch.
        if not self.on_train:
            return
        epoch, done, _ = loop.position
        state = loop.state
        if (epoch, done) == (state.epoch, state.batch_idx + 1) and (epoch, done) not in \
                self._boundaries:
            self._snapshot(loop)

    def _snapshot(self, loop: Loop) -> None:
        """Keep the training sums at this batch, and those at the loop's position (the last
        boundary it recorded), for `state_dict`; drop any other."""
        if not self._training.functions:
            return
        state = loop.state
        epoch, done, _ = loop.position
        self._boundaries = {key: value for key, value in self._boundaries.items()
                            if key == (epoch, done)}
        # Tensors are replaced, never changed in place: keeping references is a snapshot.
        self._boundaries[(state.epoch, state.batch_idx + 1)] = (
            dict(self._training.sums), self._training.samples)

    def _write_train(self, loop: Loop) -> None:
        # Every rank gets here at the same events: the reduction inside results() must not
        # depend on this rank's own sample count (its shard may have been empty).
        if self._train_pending:
            loop.state.metrics.update(self._training.results("train_", "training"))
        self._train_pending = False

    def on_epoch_end(self, loop: Loop) -> None:
        if self.on_train:
            self._write_train(loop)

    # -------------------------------------------------------------- validation
    def _warn_unsynced(self) -> None:
        """Under DDP, once: name the object metrics that report this rank's shard only."""
        if self._warned_unsynced or distributed.world_size() < 2:
            return
        self._warned_unsynced = True
        local = [name for name, metric in self._validation.objects.items()
                 if not synchronises_itself(metric)]
        if local and distributed.is_main():
            warnings.warn(
                f"{self!r}: under DDP ({distributed.world_size()} processes) the metric "
                f"object(s) {', '.join(map(repr, local))} do not synchronise across ranks (no "
                "sync()/dist_sync_on_step as torchmetrics objects have), so compute() reports "
                "this rank's shard of the data only. Use a torchmetrics metric, or a function "
                "fn(outputs, targets) -> batch mean, which Metrics reduces over all ranks.",
                RuntimeWarning, stacklevel=2)

    def on_validation_start(self, loop: Loop) -> None:
        self._warn_unsynced()
        if self.on_train and loop.epoch_completed:  # not a validation in the middle of an epoch
            self._write_train(loop)
        self._validation.reset(loop.device)

    def on_validation_batch_end(self, loop: Loop) -> None:
        self._update(self._validation, loop)

    def on_validation_end(self, loop: Loop) -> None:
        # Every rank, also one with an empty validation shard: results() is a collective.
        prefix = loop.state.prefix
        loop.state.metrics.update(self._validation.results(f"{prefix}_", "validation"))

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The training sums at the loop's resume position (empty without ``on_train``)."""
        if not self.on_train or self._loop is None or distributed.world_size() > 1:
            return {}  # under DDP each rank holds its own sums and only rank 0 writes
        epoch, done, _ = self._loop.position
        if (epoch, done) not in self._boundaries:
            return {}
        sums, samples = self._boundaries[(epoch, done)]
        return {"epoch": epoch, "batch_idx": done, "samples": samples,
                "sums": {name: value.detach().cpu() for name, value in sums.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the training sums of an interrupted epoch (used at its next start)."""
        if state and "sums" in state:
            key = (int(state["epoch"]), int(state["batch_idx"]))
            self._boundaries[key] = (dict(state["sums"]), int(state["samples"]))
