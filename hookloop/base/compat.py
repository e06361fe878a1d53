"""The private torch APIs hookloop uses, in one place, each with a fallback on public API.

A private name (``torch._foreach_lerp_``, ``GradScaler._get_scale_async``...) can change
or vanish in any torch release. hookloop reaches them only through this module, so a
torch upgrade that breaks one breaks it here, where the fallback is: the fallbacks give
the same results through public API, at some cost (a per-tensor loop instead of one
fused kernel, a host sync where the private call had none). A test checks that no other
module of hookloop touches a private torch attribute.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["foreach_copy_", "foreach_lerp_", "foreach_mul_", "generic_grad_scaler_step",
           "loss_scale", "summary_file_writer", "summary_writer_thread", "compiled_original",
           "forget_compiled", "no_new_persistent_iterator", "loader_view", "seed_worker_as",
           "worker_queues"]

_AMP_SCALING = "_step_supports_amp_scaling"


def foreach_copy_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``target.copy_(source)`` for each pair, as one fused call where torch has it.

    No host sync either way. Call it under ``torch.no_grad()`` for tensors that require
    gradients.

    Example:
        >>> targets, sources = [torch.zeros(2), torch.zeros(1)], [torch.ones(2), torch.ones(1)]
        >>> foreach_copy_(targets, sources)
        >>> [t.tolist() for t in targets]
        [[1.0, 1.0], [1.0]]
    """
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None:
        fused(targets, sources)
        return
    for target, source in zip(targets, sources):
        target.copy_(source)


def foreach_lerp_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
                  weight: float) -> None:
    """``target += weight * (source - target)`` for each pair, fused where torch has it.

    Example:
        >>> targets = [torch.zeros(2)]
        >>> foreach_lerp_(targets, [torch.full((2,), 4.0)], 0.25)
        >>> targets[0].tolist()
        [1.0, 1.0]
    """
    fused = getattr(torch, "_foreach_lerp_", None)
    if fused is not None:
        fused(targets, sources, weight)
        return
    for target, source in zip(targets, sources):
        target.lerp_(source, weight)


def foreach_mul_(tensors: Sequence[torch.Tensor], factor: float) -> None:
    """``tensor *= factor`` for each tensor, fused where torch has it.

    Example:
        >>> tensors = [torch.ones(2), torch.full((1,), 2.0)]
        >>> foreach_mul_(tensors, 3.0)
        >>> [t.tolist() for t in tensors]
        [[3.0, 3.0], [6.0]]
    """
    fused = getattr(torch, "_foreach_mul_", None)
    if fused is not None:
        plain = [tensor for tensor in tensors if type(tensor) is torch.Tensor]
        if len(plain) in (0, len(tensors)):
            fused(tensors, factor)
        else:  # DTensors (tensor parallel) and plain tensors: torch refuses one call of both
            fused(plain, factor)
            fused([tensor for tensor in tensors if type(tensor) is not torch.Tensor], factor)
        return
    for tensor in tensors:
        tensor.mul_(factor)


@contextmanager
def generic_grad_scaler_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside the block, ``GradScaler.step(optimizer)`` treats ``optimizer`` like any other.

    Fused and capturable optimizers (``Adam(fused=True)``) declare
    ``_step_supports_amp_scaling``: GradScaler then calls their ``step`` even for a step
    with inf/NaN gradients and lets the kernel skip it on the device, so whoever watches
    ``optimizer.step`` would count a step that did not happen. Turned off for the block,
    GradScaler takes its generic path: it calls ``step`` only when the gradients are finite.
    The gradients must be unscaled already (``scaler.unscale_``), as the generic path
    expects. Put back afterwards, also on an exception. Without the attribute (a torch
    without fused AMP steps) there is nothing to turn off.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with generic_grad_scaler_step(optimizer):
        ...     pass
    """
    if not getattr(optimizer, _AMP_SCALING, False):
        yield
        return
    own = _AMP_SCALING in vars(optimizer)  # set on the instance, or by its class
    saved = vars(optimizer).get(_AMP_SCALING)
    setattr(optimizer, _AMP_SCALING, False)
    try:
        yield
    finally:
        if own:
            setattr(optimizer, _AMP_SCALING, saved)
        else:
            delattr(optimizer, _AMP_SCALING)


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scaler's current scale as a tensor on its device, without a host sync.

    None before the scaler scaled anything (it makes its scale tensor at first use) and for
    a disabled scaler. The public fallback, ``scaler.get_scale()``, returns a float and
    syncs: use it only where a sync happens anyway.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        >>> _ = scaler.scale(torch.ones(()))
        >>> float(loss_scale(scaler))
        8.0
    """
    if not scaler.is_enabled():
        return None
    scale_async = getattr(scaler, "_get_scale_async", None)
    if callable(scale_async):
        return scale_async()
    return torch.tensor(scaler.get_scale())


def summary_file_writer(writer: Any) -> Any:
    """The event-file writer inside a ``torch.utils.tensorboard.SummaryWriter``.

    For writing ready-made summaries (``add_summary``) into the writer's own event file, as
    its public methods do. The fallback is the writer's ``file_writer`` attribute, which
    the SummaryWriter sets when it opens its file.

    Example:
        >>> import tempfile
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> writer = SummaryWriter(tempfile.mkdtemp())
        >>> summary_file_writer(writer) is not None
        True
        >>> writer.close()
    """
    get_file_writer = getattr(writer, "_get_file_writer", None)
    if callable(get_file_writer):
        return get_file_writer()
    return writer.file_writer


def summary_writer_thread(writer: Any) -> Any:
    """The background thread that writes the event file of a ``SummaryWriter``
    (tensorboard's ``_AsyncWriterThread``), or None where tensorboard lays it out otherwise.

    Example:
        >>> import tempfile, threading
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> writer = SummaryWriter(tempfile.mkdtemp())
        >>> isinstance(summary_writer_thread(writer), threading.Thread)
        True
        >>> writer.close()
    """
    event_writer = getattr(summary_file_writer(writer), "event_writer", None)
    return getattr(getattr(event_writer, "_async_writer", None), "_worker", None)


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, for a compiled module; else None.

    Example:
        >>> compiled_original(torch.nn.Linear(2, 2)) is None
        True
    """
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else None


def forget_compiled(function: Any) -> None:
    """Drop what ``torch.compile`` cached for ``function`` and the functions it wraps.

    torch keeps compiled code per code object, not per compiled callable, and caps the
    entries of one code object (``torch._dynamo.config.recompile_limit``, 8). An
    optimizer's step is compiled with guards on that optimizer, so each fit with a new
    optimizer of the same class adds entries to the same ``step``: past the cap torch
    silently runs the step uncompiled, which rounds differently (an ``add_`` with
    ``alpha=-lr`` instead of a product then a sum). ``function`` is a callable (a bound
    method, a ``functools.wraps`` chain); each code object along ``__wrapped__`` is reset,
    so the next call compiles again. Fallback: nothing is dropped (the cap then applies).

    Example:
        >>> def step(): return 1
        >>> forget_compiled(step)
    """
    reset = getattr(getattr(torch, "_dynamo", None), "reset_code", None)
    seen: set[int] = set()
    while function is not None and id(function) not in seen and callable(reset):
        seen.add(id(function))
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        if code is not None:
            reset(code)
        function = getattr(getattr(function, "__func__", function), "__wrapped__", None)


@contextmanager
def no_new_persistent_iterator(loader: Any) -> Iterator[None]:
    """A ``DataLoader(persistent_workers=True)`` iterated inside the block keeps no iterator
    the block created: the next pass creates it, as it would have without the block.

    Creating that iterator draws the workers' base seed from torch's generator (or the
    loader's); a pass that creates it early, then has the generator put back, would make
    the later pass skip the draw, and every draw after it would shift. The workers the
    block started are shut down. An iterator that existed before the block is kept.
    Fallback: a torch without the private ``_iterator`` attribute keeps nothing to drop.

    Example:
        >>> with no_new_persistent_iterator([1, 2]):  # anything else passes through
        ...     pass
    """
    had = getattr(loader, "_iterator", None) is not None
    try:
        yield
    finally:
        iterator = getattr(loader, "_iterator", None)
        if not had and iterator is not None and getattr(loader, "persistent_workers", False):
            loader._iterator = None
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()


def loader_view(loader: Any, index_sampler: Any) -> Any:
    """A shallow copy of a ``DataLoader`` that draws its indices from ``index_sampler``
    (its batch sampler where it batches, else its sampler), with no iterator of its own;
    the loader itself is left as it is.

    DataLoader refuses to set its sampler once built, so the copy's fields are set
    directly. Fallback: none needed; these are the fields ``DataLoader.__init__`` sets.
    """
    view = copy.copy(loader)
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    view.__dict__[name] = index_sampler
    view.__dict__["_iterator"] = None
    return view


def seed_worker_as(worker: int, base_seed: int) -> None:
    """Seed Python's, torch's and NumPy's generators as a DataLoader seeds worker
    ``worker`` of an iterator whose base seed is ``base_seed``
    (``torch.utils.data._utils.worker._worker_loop``). Fallback: NumPy seeded from the
    same 32-bit words through its public SeedSequence when the private helper is gone."""
    random.seed(base_seed + worker)
    torch.manual_seed(base_seed + worker)
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with most torch installs
        return
    try:
        from torch.utils.data._utils.worker import _generate_state

        numpy.random.seed(_generate_state(base_seed, worker))
    except ImportError:  # pragma: no cover - a torch that moved it
        numpy.random.seed([worker, base_seed & 0xFFFFFFFF, base_seed >> 32, 0])


def worker_queues(item: Any) -> list[Any] | None:
    """The queues of a DataLoader iterator with worker processes (torch's
    ``_MultiProcessingDataLoaderIter``): each worker's index queue and the result queue;
    None for any other object.

    Fallback: None where torch names them otherwise; those workers then stop as torch
    stops them (`hookloop.engine.data.worker_queues_kept` keeps nothing for them).

    Example:
        >>> worker_queues(iter([1, 2])) is None
        True
    """
    kind = getattr(torch.utils.data.dataloader, "_MultiProcessingDataLoaderIter", None)
    if kind is None or not isinstance(item, kind):
        return None
    found = [*getattr(item, "_index_queues", ()), getattr(item, "_worker_result_queue", None)]
    return [queue for queue in found if queue is not None]
