"""The data of a `FaultTolerance` run: each replica group's shard of every batch, and a
missing group's shard, trained by a live group in its place."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from hookloop.engine.data import move_to_device
from hookloop.engine.forward import ForwardRule, check_loss
from hookloop.engine.samplers import shard_loader
from hookloop.errors import ConfigurationError
from hookloop.parallel import ft_plan

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["shard_data", "train_window"]


def shard_data(loop: Loop, replicas: int, replica: int) -> Any:
    """Replace ``loop.train_data`` by this process's shard (``replica`` of ``replicas``:
    groups times the ranks of a group); returns its sampler, which indexes every sample."""
    data = loop.train_data
    if not isinstance(data, torch.utils.data.DataLoader) or \
            isinstance(data.dataset, torch.utils.data.IterableDataset):
        raise ConfigurationError(
            "FaultTolerance needs the training data as a DataLoader over a map-style "
            f"dataset (got {type(data).__name__}): a live group trains a missing group's "
            "shard by index, so it must be able to read any sample.")
    loop.train_data = shard_loader(data, training=True, owner="FaultTolerance", reshard=True,
                                   replicas=(replicas, replica))
    return loop.train_data.sampler


def train_window(loop: Loop, sampler: Any, replicas: int, replica: int) -> torch.Tensor:
    """A missing group's shard (``replica`` of ``replicas``) of every batch of this step's
    accumulation window (one batch without `GradAccumulation`; windows start at multiples
    of its ``steps`` in an epoch), accumulated; returns the loss of the window's last
    batch, as the loop's."""
    state = loop.state
    last = state.batch_idx
    loss = torch.zeros(())
    try:
        for batch in range(last - last % loop.accumulation_steps, last + 1):
            state.batch_idx = batch  # a scale_loss reads its window from it
            loss = _train_shard(loop, sampler, replicas, replica, batch)
    finally:
        state.batch_idx = last
    return loss


def _train_shard(loop: Loop, sampler: Any, replicas: int, replica: int,
                 batch_idx: int) -> torch.Tensor:
    """Forward and backward of a missing group's shard of batch ``batch_idx``,
    accumulated; returns the shard's loss."""
    data = loop.train_data
    indices = ft_plan.shard_indices(
        len(sampler.dataset), replicas, replica, epoch=loop.state.epoch, batch=batch_idx,
        batch_size=data.batch_size, shuffle=sampler.shuffle, seed=sampler.seed)
    batch = move_to_device(data.collate_fn([data.dataset[i] for i in indices]), loop.device)
    rule = ForwardRule(loop, loop.forward, loop.loss_fn, loop.inputs, loop.targets)
    with contextlib.ExitStack() as stack:
        for callback in loop.callbacks:
            context = callback.forward_context(loop)
            if context is not None:
                stack.enter_context(context)
        _, loss = rule.compute(loop.model, batch)
    loss = check_loss(loss, training=True)
    value = loss.detach().float().reshape(())
    for callback in loop.callbacks:
        loss = callback.scale_loss(loop, loss)
    loss.backward()
    return value
