"""``torch.compile`` for the model (and the optimizer step), after DDP or FSDP wrapped it."""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from hookloop.base.checks import check_flag
from hookloop.base.compat import compiled_original, forget_compiled
from hookloop.base.modules import unwrap
from hookloop.callback import Callback
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["Compile"]

#: What torch's schedulers mark the ``optimizer.step`` they track with (an attribute of
#: their own wrapper, public by use). The compiled step calls that wrapper, so it is
#: marked too: the scheduler does not warn that the step was replaced behind its back.
_SCHEDULER_MARK = "_wrapped_by_lr_sched"

def _compile_arguments() -> set[str]:
    return set(inspect.signature(torch.compile).parameters) - {"model"}


class Compile(Callback):
    """Compile the model with ``torch.compile`` for the fit; optionally the optimizer step.

    The model is compiled at fit start, after `DDP` (or FSDP) wrapped it: compiling the
    wrapper lets DDP split the graph at its gradient buckets, so communication still
    overlaps backward (compiling inside DDP would lose that). The stack check puts
    Compile after them. ``loop.model`` stays the module it was: the compiled one is put in
    place only around each forward (training, validation, ``predict``), so DDP's
    unwrapping, ``loop.unwrapped_model`` and every checkpoint see the model itself, and
    state-dict keys never carry ``_orig_mod.``; a checkpoint of a compiled run loads into
    an uncompiled model as it is. Callbacks that run the model themselves (`ModelSummary`,
    ``TensorBoard(graph=True)``) run it uncompiled. A custom ``forward(loop, batch)``
    should call ``loop.model`` (not a model captured elsewhere) to get the compiled one.

    Recompiles. Compiling happens lazily, at the first call of each kind; in the first
    epoch expect, per kind of pass, one graph for the training forward and one for
    validation (eval mode, no gradients; the sanity check before training is the first
    validation), and one more of each when the last batch of an epoch is smaller (torch
    then makes that dimension dynamic, once). After that nothing in the loop or the
    built-in callbacks recompiles: the EMA's validation swap copies into the same tensors,
    autocast is the same in training and validation, accumulation and clipping act outside
    the model. Under DDP, the validation pass runs the unwrapped module, which is
    compiled once more. ``TORCH_LOGS=recompiles`` prints every recompile with its reason.

    ``optimizer=True`` also compiles ``loop.optimizer.step`` (through whatever calls it:
    a plain step or AMP's GradScaler). A compiled function specialized on a float
    argument recompiles whenever the float changes, so a learning-rate schedule would
    recompile the step at every step (torch before 2.6 specializes floats; later ones
    lift them into inputs unless ``torch._dynamo.config.specialize_float`` is set). The
    learning rates are therefore turned into 0-dim CPU tensors for the fit (torch's
    schedulers then fill them in place; one set as a float since, as `LRScheduler` does
    when it rewinds a schedule, is turned again before the next step) and back into
    floats at fit end, and checkpoints hold them as floats. ``fullgraph`` is not applied
    to the optimizer step. torch caches the compiled step per code object (one
    ``SGD.step`` for all SGD optimizers), a few entries per optimizer, and past its cap
    (``recompile_limit``) runs the step uncompiled, which rounds differently: the cache of
    the step's code objects is dropped when the step of another optimizer than the last
    one is compiled, so every fit in a process runs the same compiled step and resumes
    bitwise (a second fit of the same loop keeps its compiled step).

    Args:
        optimizer: Also compile the optimizer step.
        **torch_compile_kwargs: Passed to ``torch.compile``: ``backend`` ("inductor" by
            default; "aot_eager" or "eager" compile in seconds), ``mode``
            ("reduce-overhead", "max-autotune"), ``dynamic``, ``fullgraph``, ``options``.

    Raises:
        ConfigurationError: an argument ``torch.compile`` does not take; at setup, a model
            that is compiled already (pass the plain model and let Compile compile it).

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[Compile(backend="eager")])
        >>> loop.fit(1).step
        hookloop: training ended at epoch 1/1, step 3: its 1 epoch is done.
        3
        >>> sorted(loop.state_dict()["model"])[:2]  # the model's own keys
        ['0.bias', '0.weight']
    """

    unique = True
    #: The optimizer whose step was compiled last (by any Compile): its cached code is kept.
    _last_step_of: ClassVar[Callable[[], Any]] = staticmethod(lambda: None)
    #: The display (`ProgressBar`) says "compiling" during the first batches.
    roles: ClassVar[tuple[str, ...]] = ("compiles",)
    runs_after = {
        "ActivationCheckpointing": "the compiled graph must hold the checkpointed blocks "
                                   "(checkpointing after compiling changes modules the "
                                   "compiled code no longer calls)",
        "distributed": "torch.compile must wrap the DDP/FSDP model (DDP splits the compiled "
                       "graph at its buckets to overlap communication with backward), so the "
                       "wrapping comes first",
    }

    def __init__(self, *, optimizer: bool = False, **torch_compile_kwargs: Any) -> None:
        self.optimizer = check_flag("Compile optimizer", optimizer)
        known = _compile_arguments()
        unknown = sorted(set(torch_compile_kwargs) - known)
        if unknown:
            raise ConfigurationError(
                f"Compile torch_compile_kwargs must be arguments of torch.compile "
                f"({', '.join(sorted(known))}), got {unknown}.")
        self.torch_compile_kwargs = dict(torch_compile_kwargs)
        # module -> its compiled wrapper, for the modules of the current fit (kept across
        # fits of the same model, so a second fit does not compile again).
        self._compiled: dict[int, tuple[nn.Module, nn.Module]] = {}
        self._step: tuple[Any, Any, Callable[..., Any]] | None = None  # (optimizer, own, compiled)
        self._tensor_lrs: list[dict[str, Any]] = []
        self._hook: Any = None

    def __repr__(self) -> str:
        settings = [f"{key}={value!r}" for key, value in self.torch_compile_kwargs.items()]
        if self.optimizer:
            settings.insert(0, "optimizer=True")
        return f"Compile({', '.join(settings)})"

    # ------------------------------------------------------------------ events
    def setup(self, loop: Loop) -> None:
        """Refuse a model that is compiled already (it would be compiled twice)."""
        if compiled_original(loop.model) is not None:
            raise ConfigurationError(
                "Compile was given a model that is compiled already (torch.compile(model)). "
                "Pass the model itself to the Loop: Compile compiles it at fit start, after "
                "DDP or FSDP wrapped it, which is the order that works. Or leave Compile out.")

    def on_fit_start(self, loop: Loop) -> None:
        """Compile the model as it is now (wrapped by DDP/FSDP); and the step when asked."""
        current = {id(loop.model), id(unwrap(loop.model))}
        self._compiled = {key: entry for key, entry in self._compiled.items() if key in current}
        self._compiled_module(loop.model)
        if self.optimizer:
            self._compile_step(loop.optimizer)

    def before_step(self, loop: Loop) -> None:
        """With the step compiled: learning rates set as floats since (a schedule rewound
        after the sanity check, a callback) become tensors again before the step."""
        if self._step is not None:
            self._tensor_learning_rates(loop.optimizer)

    def forward_context(self, loop: Loop) -> AbstractContextManager[Any]:
        """Put the compiled module in ``loop.model`` for the forward, then the module back."""
        return self._swapped(loop)

    def on_fit_end(self, loop: Loop) -> None:
        """The optimizer's own step and float learning rates again."""
        self._restore_step()

    # ------------------------------------------------------------------ inside
    def _compiled_module(self, module: nn.Module) -> nn.Module:
        entry = self._compiled.get(id(module))
        if entry is None or entry[0] is not module:
            entry = (module, cast(nn.Module, torch.compile(module, **self.torch_compile_kwargs)))
            self._compiled[id(module)] = entry
        return entry[1]

    @contextmanager
    def _swapped(self, loop: Loop) -> Iterator[None]:
        module = loop.model
        loop.model = self._compiled_module(module)
        try:
            yield
        finally:
            loop.model = module

    def _tensor_learning_rates(self, optimizer: Any) -> None:
        """Tensor learning rates: the compiled step reads them as inputs, not constants."""
        for group in optimizer.param_groups:
            if not isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]))
                if all(group is not seen for seen in self._tensor_lrs):
                    self._tensor_lrs.append(group)
        if self._tensor_lrs and self._hook is None:
            self._hook = optimizer.register_state_dict_post_hook(self._float_lrs)

    def _compile_step(self, optimizer: Any) -> None:
        self._tensor_lrs = []
        self._tensor_learning_rates(optimizer)
        own = vars(optimizer).get("step")  # a scheduler's tracking wrapper, or nothing
        step = optimizer.step
        arguments = {key: value for key, value in self.torch_compile_kwargs.items()
                     if key != "fullgraph"}

        def optimizer_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            return step(*args, **kwargs)

        # What earlier fits compiled for other optimizers (of this class) is dropped: each
        # new optimizer adds guarded entries to the same code objects, and past torch's cap
        # the step would run uncompiled, silently, rounding unlike the compiled one.
        if Compile._last_step_of() is not optimizer:  # a second fit of one loop keeps it
            self._forget_step(optimizer, step, optimizer_step)
        Compile._last_step_of = weakref.ref(optimizer)
        function = torch.compile(optimizer_step, **arguments)
        if getattr(step, _SCHEDULER_MARK, False):  # it calls the scheduler's wrapper still
            setattr(function, _SCHEDULER_MARK, True)
        # A bound method, as optimizer.step is: a scheduler built later wraps its __func__.
        compiled = types.MethodType(function, optimizer)
        optimizer.step = compiled
        self._step = (optimizer, own, compiled)

    @staticmethod
    def _forget_step(optimizer: Any, *functions: Callable[..., Any]) -> None:
        for function in (*functions, type(optimizer).step):
            forget_compiled(function)

    def _float_lrs(self, optimizer: Any, state: dict[str, Any]) -> None:
        """A checkpoint holds float learning rates, as an uncompiled run expects."""
        for group in state.get("param_groups", ()):
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])  # a CPU tensor: no device sync

    def _restore_step(self) -> None:
        if self._step is not None:
            optimizer, own, compiled = self._step
            self._step = None
            if vars(optimizer).get("step") is compiled:  # else someone wrapped it since
                if own is None:
                    del optimizer.step
                else:
                    optimizer.step = own
        for group in self._tensor_lrs:
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])
        self._tensor_lrs = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
