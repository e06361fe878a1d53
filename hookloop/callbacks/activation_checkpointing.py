"""Activation checkpointing: chosen blocks keep fewer activations from forward to backward
and recompute the rest in backward (torch's non-reentrant ``torch.utils.checkpoint``)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from hookloop.callback import Callback
from hookloop.errors import ConfigurationError
from hookloop.parallel.blocks import check_wrap, chosen_blocks

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["ActivationCheckpointing", "saved_activation_bytes"]

_OP_KINDS = ("OpOverload", "OpOverloadPacket")
_checkpointed: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


class _CheckpointedForward:
    """A block's forward run under ``torch.utils.checkpoint`` when gradients are on.

    Put on the block as its instance attribute ``forward``: the block stays the same module
    (its state-dict keys and those of its parents keep their names: no wrapper, no prefix),
    and hooks on the block (FSDP's gathering, tensor parallel's redistribution) still run
    around it, once, in forward. The recompute in backward calls the block's own forward,
    not the module, so those hooks are not run a second time.
    """

    def __init__(self, forward: Callable[..., Any], context_fn: Callable[[], Any] | None) -> None:
        self.forward = forward  # the bound method (a deep copy of the block rebinds it)
        self.context_fn = context_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # validation, predict: nothing is kept for backward
            return self.forward(*args, **kwargs)
        options: dict[str, Any] = {"use_reentrant": False}
        if self.context_fn is not None:
            options["context_fn"] = self.context_fn
        return torch.utils.checkpoint.checkpoint(self.forward, *args, **options, **kwargs)


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """The chosen blocks not inside another chosen one (a checkpoint inside a checkpoint
    recomputes twice and saves nothing more)."""
    inner = {id(child) for block in blocks for child in block.modules() if child is not block}
    return [block for block in blocks if id(block) not in inner]


def _context_fn(policy: Any) -> Callable[[], Any] | None:
    if policy is None:
        return None
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _check_policy(policy: Any) -> Any:
    if policy is None or callable(policy):
        return policy
    ops = list(policy) if isinstance(policy, (list, tuple, set, frozenset)) else None
    # By class name: torch's op classes live in a private module.
    if ops is None or not ops or not all(type(op).__name__ in _OP_KINDS for op in ops):
        raise ConfigurationError(
            "ActivationCheckpointing policy must be None (full: recompute every chosen "
            "block), a non-empty list of aten ops whose outputs are saved (selective: "
            "e.g. [torch.ops.aten.mm.default]), or a policy function (ctx, op, *args, "
            f"**kwargs) -> torch.utils.checkpoint.CheckpointPolicy, got {policy!r}.")
    # An op packet (torch.ops.aten.mm) stands for its default overload, which is what runs.
    return [op.default if type(op).__name__ == "OpOverloadPacket" else op for op in ops]


class ActivationCheckpointing(Callback):
    """Trade compute for memory: the chosen blocks keep (almost) none of their activations
    from forward to backward and recompute them in backward.

    In ``setup`` each chosen block's forward is put under torch's non-reentrant
    ``torch.utils.checkpoint.checkpoint`` (only when gradients are on: validation and
    ``predict`` run the forward as it is). The block stays the module it was, so the
    state-dict keys carry no wrapper prefix (``_checkpoint_wrapped_module.``) and a
    checkpoint of a checkpointed run loads anywhere. The random state is saved before each
    block's forward and restored for its recompute, so dropout draws the same mask twice:
    the gradients are bit for bit those of the run without checkpointing.

    Two kinds:

    * full (``policy=None``): a block saves only its inputs; everything inside is
      recomputed in backward (one more forward of each block);
    * selective (``policy``): torch's ``create_selective_checkpoint_contexts``: the
      outputs of the listed ops are saved (``[torch.ops.aten.mm.default]``: the matrix
      products, the expensive part), the rest (activations, norms, dropout) recomputed;
      or a policy function of your own.

    Order: checkpointing is applied first, then `TensorParallel`, then `FSDP`, then
    `Compile` (each wraps what the one before made); the stack check refuses another order
    before the first batch, naming both callbacks.

    Args:
        wrap: The blocks to checkpoint, chosen as `FSDP`'s ``wrap``: a set of module
            classes, or a callable ``module -> bool`` asked for every submodule; None:
            every direct child holding at least 2% of the parameters
            (`hookloop.parallel.blocks.default_blocks`). A block inside another chosen one is left
            to its parent's checkpoint.
        policy: None (full), a list of aten ops to save, or a policy function
            ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``.

    Raises:
        ConfigurationError: a bad ``wrap`` or ``policy``; at setup, a ``wrap`` that
            chooses no block.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(),
        ...                             torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1))]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[ActivationCheckpointing(wrap={torch.nn.Linear})])
        >>> loop.fit(1).step
        hookloop: training ended at epoch 1/1, step 1: its 1 epoch is done.
        1
        >>> sorted(model.state_dict())  # no wrapper prefix
        ['0.bias', '0.weight', '3.bias', '3.weight']
    """

    unique: ClassVar[bool] = True

    def __init__(self, wrap: Iterable[type[nn.Module]] | Callable[[nn.Module], bool]
                 | None = None, *, policy: Any = None) -> None:
        self.wrap = check_wrap("ActivationCheckpointing", wrap)
        self.policy = _check_policy(policy)
        self._context_fn = _context_fn(self.policy)
        #: The blocks checkpointed by the last setup.
        self.blocks: list[nn.Module] = []

    def __repr__(self) -> str:
        kind = "full" if self.policy is None else "selective"
        return f"ActivationCheckpointing({kind})"

    def setup(self, loop: Loop) -> None:
        """Put each chosen block's forward under checkpoint (once per block)."""
        model = loop.unwrapped_model
        blocks = _outermost(chosen_blocks(model, self.wrap))[::-1]  # in the model's order
        if not blocks:
            raise ConfigurationError(
                f"ActivationCheckpointing: wrap={self.wrap!r} chooses no block of "
                f"{type(model).__name__}, so nothing would be checkpointed. Pass the class of "
                "the model's repeated block (wrap={TransformerBlock}) or a callable module -> "
                "bool; the root module itself cannot be chosen.")
        for block in blocks:
            current = _checkpointed.get(block)
            if current is not None and vars(block).get("forward") is current:
                continue  # a second fit: checkpointed already
            patched = _CheckpointedForward(block.forward, self._context_fn)
            block.forward = patched
            _checkpointed[block] = patched
        self.blocks = blocks


def saved_activation_bytes(run: Callable[[], Any], model: nn.Module | None = None) -> int:
    """The bytes autograd keeps for backward while ``run()`` runs a forward: the distinct
    storages of the tensors saved by ops outside a checkpointed block (the parameters of
    ``model`` not counted: they are held anyway).

    Counted with ``torch.autograd.graph.saved_tensors_hooks``. Inside a block under full
    checkpointing nothing is kept, so nothing is counted; under selective checkpointing
    the saved outputs are held by torch's policy cache, which these hooks do not see
    (``benchmarks/activation_memory.py`` counts those apart).

    Example:
        >>> layer = torch.nn.Linear(4, 4)
        >>> saved_activation_bytes(lambda: layer(torch.randn(2, 4)).relu().sum(), layer)
        64
    """
    held = set() if model is None else {param.untyped_storage().data_ptr()
                                         for param in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())
