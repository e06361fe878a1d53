"""Compile on CPU: no recompile after the first epoch (torch's dynamo counters), the same
weights as the eager run, clean checkpoint keys, and the optimizer step compiled with
tensor learning rates.

Backends: "aot_eager" for the parity checks (dynamo's capture and AOTAutograd's
functionalized forward and backward, run with eager kernels) and "eager" for the recompile
counts (guards and recompiles are decided by dynamo, before any backend). Inductor
compiles C++ kernels with gcc, about a minute per graph on the 2-core reference machine:
`test_inductor_parity` runs it when HOOKLOOP_TEST_INDUCTOR=1.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from hookloop import Callback, CallbackOrderError, ConfigurationError, Loop, load_checkpoint
from hookloop.callbacks import (
    AMP,
    DDP,
    EMA,
    Checkpoint,
    Compile,
    GradAccumulation,
    GradClip,
    LRScheduler,
    Metrics,
)
from hookloop.schedules import warmup_cosine

pytestmark = pytest.mark.filterwarnings("ignore:DDP. not launched by torchrun")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


class GraphsPerEpoch(Callback):
    """Dynamo's count of compiled graphs at every epoch end."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_epoch_end(self, loop) -> None:
        self.seen.append(graphs())


def accuracy(outputs, targets):
    return (outputs.argmax(-1) == targets).float().mean()


def make_loop(callbacks, *, seed: int = 0, optimizer: str = "adamw",
              dropout: float = 0.1) -> Loop:
    """A model with Dropout by default; without, for parity: compiled dropout draws its
    masks differently from eager (a decomposition, or inductor's own generator)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(dropout),
                                torch.nn.ReLU(), torch.nn.Linear(16, 3))
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = torch.randn(70, 6, generator=generator), torch.randint(0, 3, (70,),
                                                                            generator=generator)
    # 50 samples in batches of 8: the last training batch has 2, the last validation batch 4.
    train = [(inputs[i:i + 8], targets[i:i + 8]) for i in range(0, 50, 8)]
    val = [(inputs[i:i + 8], targets[i:i + 8]) for i in range(50, 70, 8)]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return Loop(model, opt, train, val_data=val, loss_fn=F.cross_entropy, callbacks=callbacks,
                device="cpu")


def stack() -> list[Callback]:
    return [AMP(torch.bfloat16), GradAccumulation(2), GradClip(1.0), EMA(0.9),
            LRScheduler(functools.partial(warmup_cosine, warmup_steps=0.2)),
            Metrics(acc=accuracy)]


def test_the_stack_compiles_in_the_first_epoch_and_never_again() -> None:
    counted = GraphsPerEpoch()
    loop = make_loop([DDP(), *stack(), Compile(backend="eager", optimizer=True), counted])
    loop.fit(4)
    # Model: training, training's smaller last batch (the batch dimension made dynamic),
    # validation (eval, no grad), its smaller last batch; plus the optimizer step.
    assert counted.seen[0] <= 5
    assert counted.seen == [counted.seen[0]] * 4, counted.seen
    # A second fit of the same loop compiles nothing either.
    loop.fit(6)
    assert graphs() == counted.seen[0]


def test_a_schedule_recompiles_a_step_compiled_over_float_learning_rates() -> None:
    """The counter the tests rely on does see recompiles: with floats specialized (torch
    before 2.6 always did), a step compiled by hand over float learning rates that a
    schedule changes recompiles at every step; Compile's tensor learning rates do not.
    The option is set with torch's own ``config.patch``: pytest's monkeypatch undoes a
    module attribute served by ``__getattr__`` with ``delattr`` (pytest 9.2), and torch's
    config answers a delete by hiding the option from every later test of the process."""
    with torch._dynamo.config.patch(specialize_float=True):
        _recompiles_per_step_over_float_learning_rates()


def _recompiles_per_step_over_float_learning_rates() -> None:
    class CompileTheStep(Callback):
        def on_fit_start(self, loop) -> None:  # after LRScheduler built its scheduler
            step = loop.optimizer.step
            compiled = torch.compile(lambda optimizer, *a, **k: step(*a, **k), backend="eager")
            loop.optimizer.step = types.MethodType(compiled, loop.optimizer)

    counted = GraphsPerEpoch()
    loop = make_loop([*stack(), CompileTheStep(), counted])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Seems like `optimizer.step\\(\\)` has been overridden")
        loop.fit(2)
    assert counted.seen[1] > counted.seen[0]

    torch._dynamo.reset()
    counters.clear()
    counted = GraphsPerEpoch()
    make_loop([*stack(), Compile(backend="eager", optimizer=True), counted]).fit(3)
    assert counted.seen == [counted.seen[0]] * 3


def _weights(loop: Loop) -> list[torch.Tensor]:
    return [tensor.detach().clone() for tensor in loop.unwrapped_model.state_dict().values()]


@pytest.mark.parametrize("optimizer_step", [False, True], ids=["model", "model+optimizer"])
def test_a_compiled_fit_ends_on_the_eager_weights(optimizer_step: bool) -> None:
    # With the step compiled: SGD. A compiled Adam computes its bias corrections as float32
    # tensors where eager Adam uses Python floats, a difference of about 1e-5 after a few
    # steps, which is torch's, not the loop's.
    optimizer = "sgd" if optimizer_step else "adamw"
    eager = make_loop(stack(), dropout=0.0, optimizer=optimizer)
    eager_state = eager.fit(2)
    compiled = make_loop([*stack(), Compile(backend="aot_eager", optimizer=optimizer_step)],
                         dropout=0.0, optimizer=optimizer)
    compiled_state = compiled.fit(2)
    for a, b in zip(_weights(eager), _weights(compiled)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    assert compiled_state.metrics["val_loss"] == pytest.approx(eager_state.metrics["val_loss"],
                                                               abs=1e-6)


@pytest.mark.skipif(os.environ.get("HOOKLOOP_TEST_INDUCTOR") != "1",
                    reason="inductor compiles C++ kernels: about a minute per graph here")
def test_inductor_parity() -> None:
    eager = make_loop([GradClip(1.0)], optimizer="sgd", dropout=0.0)
    eager.fit(2)
    compiled = make_loop([GradClip(1.0), Compile()], optimizer="sgd", dropout=0.0)
    compiled.fit(2)
    for a, b in zip(_weights(eager), _weights(compiled)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_a_checkpoint_of_a_compiled_run_loads_into_an_uncompiled_model(tmp_path: Path) -> None:
    loop = make_loop([*stack(), Compile(backend="aot_eager", optimizer=True),
                      Checkpoint(tmp_path, monitor="val_acc", mode="max")])
    loop.fit(2)
    for name in ("best.pt", sorted(p.name for p in tmp_path.glob("epoch*.pt"))[-1]):
        payload = torch.load(tmp_path / name, weights_only=True)
        assert not [key for key in payload["model"] if "_orig_mod" in key]
        if "optimizer" in payload:  # rotating files (best.pt keeps the weights only)
            assert all(isinstance(group["lr"], float)
                       for group in payload["optimizer"]["param_groups"])
    fresh = make_loop([], seed=1).model
    load_checkpoint(tmp_path / "best.pt", fresh)
    best = torch.load(tmp_path / "best.pt", weights_only=True)["model"]
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, best[key])


def test_after_the_fit_the_loop_holds_the_model_and_optimizer_as_they_were() -> None:
    loop = make_loop([*stack(), Compile(backend="eager", optimizer=True)])
    model = loop.model
    loop.fit(1)
    assert loop.model is model
    # What is left on the instance is torch's scheduler's own tracking wrapper, if anything.
    own = vars(loop.optimizer).get("step")
    assert own is None or not hasattr(own, "_torchdynamo_orig_callable")
    assert all(isinstance(group["lr"], float) for group in loop.optimizer.param_groups)


class SeesTheModel(Callback):
    def __init__(self) -> None:
        self.inside: list[str] = []
        self.outside: list[str] = []

    def on_batch_start(self, loop) -> None:
        self.outside.append(type(loop.model).__name__)


def test_the_compiled_module_is_in_place_only_during_the_forward() -> None:
    seen = SeesTheModel()

    def forward(loop, batch):
        seen.inside.append(type(loop.model).__name__)
        inputs, targets = batch
        outputs = loop.model(inputs)
        return outputs, F.cross_entropy(outputs, targets)

    loop = make_loop([Compile(backend="eager"), seen])
    loop.forward = forward
    loop.fit(1)
    assert set(seen.inside) == {"OptimizedModule"}
    assert set(seen.outside) == {"Sequential"}


def test_a_model_compiled_already_is_refused() -> None:
    loop = make_loop([Compile(backend="eager")])
    loop.model = torch.compile(loop.model, backend="eager")
    with pytest.raises(ConfigurationError, match="compiled already"):
        loop.fit(1)


def test_an_unknown_argument_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="Compile torch_compile_kwargs must be arguments "
                                                 "of torch.compile .*got \\['backnd'\\]"):
        Compile(backnd="eager")


def test_compile_comes_after_ddp() -> None:
    loop = make_loop([Compile(backend="eager"), DDP()])
    with pytest.raises(CallbackOrderError, match="DDP"):
        loop.fit(1)


class _Crash(Exception):
    pass


class _CrashAfter(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, loop) -> None:
        if loop.state.step == self.step and loop.optimizer_stepped:
            raise _Crash


@torch._dynamo.config.patch(recompile_limit=4)
def test_a_compiled_step_resumes_bitwise_after_other_fits_in_the_process(tmp_path: Path) -> None:
    """torch caches compiled code per code object (``SGD.step``), guarded on the optimizer,
    and caps the entries (lowered here to 4, as if more fits had run in this process: a
    fit adds 2). Without Compile dropping the earlier fits' entries, the third fit's step
    ran uncompiled (eager ``add_(alpha=-lr)`` rounds unlike the compiled product then
    sum) and the resumed run left the uninterrupted one at the resume."""
    def run(directory: Path, *extra: Callback) -> Loop:
        loop = make_loop([GradClip(1.0), LRScheduler(functools.partial(warmup_cosine,
                                                                       warmup_steps=0.2)),
                          Compile(backend="eager", optimizer=True), *extra,
                          Checkpoint(directory, every_n_steps=1, resume=True)],
                         optimizer="sgd")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loop.fit(2)
        return loop

    reference = run(tmp_path / "reference")
    with pytest.raises(_Crash):
        run(tmp_path / "resumed", _CrashAfter(5))
    resumed = run(tmp_path / "resumed")
    assert resumed.state.step == reference.state.step == 14
    for a, b in zip(_weights(reference), _weights(resumed), strict=True):
        assert torch.equal(a, b)
