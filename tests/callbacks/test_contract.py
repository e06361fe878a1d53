"""Every built-in callback passes the same checks: alone, twice in a row, state round trip, stacked."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader

from hookloop import Callback, ConfigurationError, Loop
from hookloop import describe
import hookloop.callbacks as builtins
from hookloop.engine.ordering import overrides
from hookloop.callbacks import (
    AMP,
    ActivationCheckpointing,
    CSVLogger,
    Checkpoint,
    Compile,
    CudaSpeedups,
    DDP,
    FSDP,
    EMA,
    DetectAnomaly,
    EarlyStopping,
    GradAccumulation,
    GradClip,
    LRScheduler,
    MemoryMonitor,
    Metrics,
    MLflowLogger,
    ModelSummary,
    Profiler,
    ProgressBar,
    ShortRun,
    TensorBoard,
    TensorParallel,
    TerminateOnNaN,
    ThroughputMonitor,
    TimeLimit,
    Timer,
    WandbLogger,
)
from hookloop.callbacks.timer import TIME_METRICS
from hookloop.schedules import warmup_cosine

from builders import accuracy, classification_dataset, make_loop, sgd, shuffled, split, two_layers

# DDP outside torchrun is a no-op that says so; here that is expected.
pytestmark = [pytest.mark.filterwarnings("ignore:DDP. not launched by torchrun"),
              pytest.mark.filterwarnings("ignore:FSDP. not launched by torchrun"),
              # the same TensorBoard twice in a row writes into one log_dir: it says so
              pytest.mark.filterwarnings("ignore:TensorBoard. .* already holds event files"),
              # CudaSpeedups on CPU says it has nothing to switch
              pytest.mark.filterwarnings("ignore:CudaSpeedups. the loop runs on cpu")]


FACTORIES: dict[str, Callable[[Path], Callback]] = {
    "AMP": lambda tmp: AMP(torch.bfloat16),
    "AMP-float16": lambda tmp: AMP(torch.float16),
    "GradClip": lambda tmp: GradClip(0.5),
    "GradClip-value": lambda tmp: GradClip(max_value=0.01),
    "GradAccumulation": lambda tmp: GradAccumulation(3),
    "EMA": lambda tmp: EMA(0.9),
    "LRScheduler": lambda tmp: LRScheduler(lambda opt, total: warmup_cosine(opt, total, 0.2)),
    "LRScheduler-plateau": lambda tmp: LRScheduler(
        lambda opt, total: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0),
        monitor="val_loss"),
    "Metrics": lambda tmp: Metrics(acc=accuracy, on_train=True),
    "EarlyStopping": lambda tmp: EarlyStopping(patience=1, min_delta=10.0),
    "Checkpoint": lambda tmp: Checkpoint(tmp / "checkpoints", monitor="val_loss", keep_last=2),
    "TerminateOnNaN": lambda tmp: TerminateOnNaN(),
    "DDP": lambda tmp: DDP(),
    "FSDP": lambda tmp: FSDP(state_dict="sharded"),
    "ActivationCheckpointing": lambda tmp: ActivationCheckpointing(),
    "ActivationCheckpointing-selective": lambda tmp: ActivationCheckpointing(
        policy=[torch.ops.aten.addmm.default]),
    # one process: the plan is not applied
    "TensorParallel": lambda tmp: TensorParallel({"0": ColwiseParallel(), "3": RowwiseParallel()}),
    "TensorBoard": lambda tmp: TensorBoard(tmp / "tb", every_n_steps=2, graph=True,
                                           histograms_every_n_epochs=2),
    "ProgressBar": lambda tmp: ProgressBar(console=Console(file=io.StringIO(), force_terminal=True)),
    "ProgressBar-plain": lambda tmp: ProgressBar(console=Console(file=io.StringIO())),
    "ModelSummary": lambda tmp: ModelSummary(print_summary=False),
    "CSVLogger": lambda tmp: CSVLogger(tmp / "log.csv", every_n_steps=2),
    "Profiler": lambda tmp: Profiler(print_table=False),
    "DetectAnomaly": lambda tmp: DetectAnomaly(steps=3),
    "ShortRun": lambda tmp: ShortRun(steps=14),
    # "eager": dynamo captures and guards, no C++ kernels to build (seconds, not minutes)
    "Compile": lambda tmp: Compile(backend="eager"),
    "Compile-optimizer": lambda tmp: Compile(backend="eager", optimizer=True),
    "CudaSpeedups": lambda tmp: CudaSpeedups(),
    "ThroughputMonitor": lambda tmp: ThroughputMonitor(every_n_steps=2, flops_per_sample="measure",
                                                       peak_flops=1e12),
    "MemoryMonitor": lambda tmp: MemoryMonitor(),
    "TimeLimit": lambda tmp: TimeLimit("1:00:00"),
    "Timer": lambda tmp: Timer(),
    "MLflowLogger": lambda tmp: _mlflow(tmp),
    "WandbLogger": lambda tmp: WandbLogger("contract", dir=tmp / "wandb", mode="disabled",
                                           every_n_steps=2),
    "FaultTolerance": lambda tmp: _fault_tolerance(tmp),
}
_LIGHTHOUSES: list[object] = []  # torchft lighthouses of the FaultTolerance cases, kept alive


@pytest.fixture(autouse=True)
def _stop_lighthouses():
    yield
    while _LIGHTHOUSES:
        _LIGHTHOUSES.pop().shutdown()  # type: ignore[attr-defined]


def _fault_tolerance(tmp: Path) -> Callback:
    """One replica group (the quorum is itself) with a lighthouse in this process."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    from hookloop.callbacks import FaultTolerance

    _LIGHTHOUSES.append(server := LighthouseServer(bind="[::]:0", min_replicas=1,
                                                   join_timeout_ms=100))
    return FaultTolerance(groups=1, group=0, lighthouse=server.address(),
                          run_dir=str(tmp / "ft-run"))


def _mlflow(tmp: Path) -> MLflowLogger:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # a local store, read by the tests alone
    return MLflowLogger("contract", tracking_uri=f"file://{tmp / 'mlruns'}", every_n_steps=2)


def _build(callback: Callback, seed: int = 0) -> Loop:
    train, val = split(classification_dataset(70, features=6, classes=3, seed=seed), 50)
    return make_loop([callback], seed=seed,
                     model=lambda: two_layers(6, 16, 3, torch.nn.Dropout(0.1), torch.nn.ReLU()),
                     train=shuffled(train, 8, seed=seed), val=DataLoader(val, batch_size=8),
                     optimizer=sgd(0.05, momentum=0.9), loss_fn=F.cross_entropy)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a.cpu(), b.cpu()) or (a.isnan().all() and b.isnan().all()))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b or (a != a and b != b)


def _nonempty(value) -> bool:
    if isinstance(value, dict):
        return any(_nonempty(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_nonempty(item) for item in value)
    return value is not None


# W&B starts its service process even in mode="disabled": its cases belong to the slow run.
KINDS = [pytest.param(kind, marks=pytest.mark.slow) if kind.startswith("WandbLogger") else kind
         for kind in sorted(FACTORIES)]


def test_every_public_callback_is_under_contract() -> None:
    public = {name for name in builtins.__all__ if isinstance(getattr(builtins, name), type)}
    covered = {name.split("-")[0] for name in FACTORIES}
    assert public <= covered, f"add a factory for {sorted(public - covered)}"


@pytest.mark.parametrize("kind", KINDS)
def test_alone_and_twice_in_a_row_give_the_same_weights(kind: str, tmp_path: Path) -> None:
    runs = []
    for attempt in range(2):
        # A callback holds one run's state: each run gets its own instance (and directory).
        loop = _build(FACTORIES[kind](tmp_path / str(attempt)))
        state = loop.fit(3)
        assert state.metrics["val_loss"] == state.metrics["val_loss"]  # finite, computed
        runs.append([p.detach().clone() for p in loop.model.parameters()])
    for first, second in zip(*runs):
        assert torch.equal(first, second), f"{kind} is not deterministic from one run to the next"


@pytest.mark.parametrize("kind", KINDS)
def test_reuse_in_another_loop_is_a_clear_error(kind: str, tmp_path: Path) -> None:
    callback = FACTORIES[kind](tmp_path)
    _build(callback).fit(1)
    with pytest.raises(ConfigurationError, match=f"already ran in another Loop.*new {type(callback).__name__}"):
        _build(callback).fit(1)


@pytest.mark.parametrize("kind", KINDS)
def test_state_round_trips_and_loads_weights_only(kind: str, tmp_path: Path) -> None:
    callback = FACTORIES[kind](tmp_path)
    loop = _build(callback)
    loop.fit(2, max_steps=10)  # stops in the middle of epoch 1: state mid-epoch too
    state = callback.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    if overrides(callback, "state_dict"):
        assert _nonempty(state), f"{kind} is stateful but its state_dict() is empty after a fit"
    fresh_loop = _build(FACTORIES[kind](tmp_path / "fresh"))
    fresh = fresh_loop.callbacks[0]
    fresh_loop.fit(2, max_steps=10)  # let it build what it builds at fit start, then overwrite it
    fresh.load_state_dict(loaded)
    assert _equal(fresh.state_dict(), state)


def test_standard_stack_trains_and_describes(tmp_path: Path) -> None:
    stack = [DDP(), AMP(torch.bfloat16), GradAccumulation(2), GradClip(1.0), TerminateOnNaN(),
             EMA(0.9), LRScheduler(lambda opt, total: warmup_cosine(opt, total, 0.1)),
             Metrics(acc=accuracy), EarlyStopping(monitor="val_acc", mode="max", patience=3),
             Checkpoint(tmp_path / "ckpt", monitor="val_acc", mode="max")]
    loop = _build(stack[0])
    loop.callbacks = stack
    state = loop.fit(3)
    assert state.step == 3 * 4  # ceil(7 batches / 2) steps per epoch
    assert {"train_loss", "val_loss", "val_acc"} <= set(state.metrics)
    text = describe(stack, print_table=False)
    for callback in stack:
        assert type(callback).__name__ in text


#: What may differ between an uninterrupted run and a resumed one: measurements, and the id of
#: the tracker run each uninterrupted run creates.
KIT_IGNORES = {"MemoryMonitor": ("peak_memory_mib",),
               "ThroughputMonitor": ("samples_per_s", "batches_per_s", "tokens_per_s", "mfu"),
               "MLflowLogger": ("run_id",), "WandbLogger": ("run_id",),
               "Timer": (*TIME_METRICS, "total", "val")}  # seconds: no two runs agree


@pytest.mark.parametrize("kind", KINDS)
def test_the_authors_kit_passes_on_every_built_in_callback(kind: str, tmp_path: Path) -> None:
    """hookloop.testing.check_callback, as a callback author runs it: dispatch,
    declarations, state through a checkpoint file, exact resume at one step boundary."""
    from hookloop.testing import check_callback

    factory = FACTORIES[kind]
    if kind == "Checkpoint":  # the resumed run reuses its directory: it must resume too
        def factory(tmp: Path) -> Callback:
            return Checkpoint(tmp / "checkpoints", monitor="val_loss", keep_last=2, resume=True)
    step = 3 + sum(map(ord, kind)) % 11  # one boundary per callback (the kit draws two), spread
    check_callback(factory, tmp_path, step=step, ignore=KIT_IGNORES.get(kind.split("-")[0], ()))
