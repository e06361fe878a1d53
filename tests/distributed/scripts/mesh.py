"""torchrun script: tensor parallel, HSDP and FSDP + tensor parallel on a device mesh (gloo),
and activation checkpointing under FSDP, against the oracles of
tests/distributed/test_mesh_processes.py.

Usage: torchrun --nproc_per_node=N mesh.py OUT_DIR PHASE

PHASE:
  tp          (2 ranks) TensorParallel alone, accumulation 2 and clipping; activation
              checkpointing under FSDP against FSDP alone (dropout); then a TP run with
              checkpoints SIGKILLed by both ranks after step 4
  tp-resume   (2 ranks) the killed TP run resumed to its end
  mesh        (4 ranks) HSDP (2 replicas x 2 shards) and FSDP + TP (dp=2, tp=2), both with
              accumulation 2 and clipping, reduce-scatters counted; the FSDP + TP run writes
              full checkpoints, a second one sharded ones; then a third, with sharded
              checkpoints, SIGKILLed by every rank after step 4
  resume-dp4  (4 ranks) the killed run relaunched on (dp=2, tp=2) to its end; then both
              (dp=2, tp=2) checkpoints of epoch 0 resumed with FSDP over dp=4, tp=1, for
              one step
  resume-one  (1 process) the same, in one process without FSDP
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import out_dir, rank, regression_data, save
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Loop, distributed
from hookloop.callbacks import (
    FSDP,
    ActivationCheckpointing,
    Checkpoint,
    GradAccumulation,
    GradClip,
    TensorBoard,
    TensorParallel,
    ThroughputMonitor,
)
from hookloop.parallel.mesh import Mesh

MAX_NORM = 0.1
SAMPLES = 48
WINDOW = 16  # global samples per optimizer step in every layout (accumulation 2)


class Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.drop = nn.Dropout(dropout)
        self.down = nn.Linear(2 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(self.drop(torch.tanh(self.up(hidden))))


class Net(nn.Module):
    """An embedding, two blocks, a head: the blocks split by tensor parallel, the embedding
    and the head plain (a mix of DTensor and plain parameters)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(8, dropout), Block(8, dropout)])
        self.head = nn.Linear(8, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(inputs)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def make_model(seed: int = 3, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return Net(dropout)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


def dataset(samples: int = SAMPLES) -> TensorDataset:
    inputs, targets = regression_data(SAMPLES, seed=1).tensors
    return TensorDataset(inputs[:samples], targets[:samples], torch.arange(samples))


def forward(loop: Loop, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets, _ = batch
    outputs = loop.model(inputs)
    return outputs, nn.functional.mse_loss(outputs, targets)


def gathered(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights on every rank (each DTensor gathered: a collective)."""
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()
            .clone() for name, value in module.state_dict().items()}


class StepLog(Callback):
    """Per optimizer step: the global loss of its window (summed over the data-parallel
    ranks: a collective), the grad norm; and the sample ids of every batch this rank read."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.norms: dict[int, float] = {}
        self.ids: list[list[int]] = []
        self.metrics: list[dict[str, float]] = []
        self._window = torch.zeros(2, dtype=torch.float64)

    def on_batch_start(self, loop: Loop) -> None:
        self.ids.append(loop.state.batch[2].tolist())

    def after_forward(self, loop: Loop) -> None:
        size = len(loop.state.batch[2])
        self._window += torch.tensor([loop.state.loss.item() * size, size], dtype=torch.float64)

    def after_step(self, loop: Loop) -> None:
        total, count = distributed.data_parallel_sum(self._window).tolist()
        self.losses[loop.state.step] = total / count
        self._window.zero_()
        if loop.state.grad_norm is not None:
            self.norms[loop.state.step] = float(loop.state.grad_norm)

    def on_epoch_end(self, loop: Loop) -> None:
        self.metrics.append(dict(loop.state.metrics))


class KillAfterStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step_boundary and loop.state.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class CountReduceScatters(Callback):
    """Reduce-scatters per optimizer step: torch.distributed's reduce_scatter_single (which
    FSDP2's default reduce-scatter calls) wrapped for the fit."""

    def __init__(self) -> None:
        self.calls = 0
        self.per_step: list[int] = []
        self._original: Any = None

    def on_fit_start(self, loop: Loop) -> None:
        self._original = original = dist.reduce_scatter_single

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        dist.reduce_scatter_single = counted  # type: ignore[assignment]

    def after_step(self, loop: Loop) -> None:
        self.per_step.append(self.calls - sum(self.per_step))

    def on_fit_end(self, loop: Loop) -> None:
        dist.reduce_scatter_single = self._original  # type: ignore[assignment]


def loaders(batch_size: int, samples: int = SAMPLES) -> tuple[DataLoader, DataLoader]:
    val_inputs, val_targets = regression_data(10, seed=2).tensors
    val = TensorDataset(val_inputs, val_targets, torch.arange(10))
    return DataLoader(dataset(samples), batch_size=batch_size), DataLoader(val, batch_size=2)


def run(label: str, layout: list[Callback], batch_size: int, *, epochs: int = 2,
        extra: tuple[Callback, ...] = (), dropout: float = 0.0, max_steps: int | None = None,
        count: bool = False, samples: int = SAMPLES) -> tuple[Loop, StepLog]:
    model = make_model(dropout=dropout)
    log = StepLog()
    counter = CountReduceScatters()
    train, val = loaders(batch_size, samples)
    callbacks = [*layout, GradAccumulation(2), GradClip(MAX_NORM), *extra, log]
    if count:
        callbacks.append(counter)
    loop = Loop(model, make_optimizer(model), train, val_data=val, forward=forward,
                device="cpu", callbacks=callbacks)
    torch.manual_seed(100 + distributed.rank() % 2)  # dropout draws, the same in paired runs
    loop.fit(epochs, max_steps=max_steps)
    weights = gathered(model)
    if rank() == 0:
        save(f"{label}-weights", weights)
    kinds = sorted({type(param).__name__ for param in model.parameters()})
    save(f"{label}-log", {"losses": log.losses, "norms": log.norms, "ids": log.ids,
                          "metrics": log.metrics, "kinds": kinds,
                          "reduce_scatters": counter.per_step,
                          "data_parallel_ranks": float(
                              distributed.data_parallel_sum(torch.ones((), dtype=torch.float64))),
                          "groups": sum(1 for module in model.modules()
                                        if type(module).__name__.startswith("FSDP"))})
    return loop, log


def checkpointing_under_fsdp() -> None:
    """FSDP with and without activation checkpointing, dropout in the blocks: equal weights."""
    for label, extra in (("fsdp-plain", []), ("fsdp-checkpointed",
                                              [ActivationCheckpointing(wrap={Block})])):
        run(label, [*extra, FSDP(wrap={Block})], batch_size=8, epochs=1, dropout=0.3)


def partial_refused() -> None:
    """GradClip at fit start, with a parameter no norm can be taken of (a Partial DTensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from hookloop import ConfigurationError

    model = nn.Linear(4, 1, bias=False)
    mesh = init_device_mesh("cpu", (2,))
    model.weight = nn.Parameter(DTensor.from_local(model.weight.detach(), mesh, [Partial()]))
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                [(torch.ones(2, 4), torch.ones(2, 1))], loss_fn=nn.functional.mse_loss,
                device="cpu", callbacks=[GradClip(1.0)])
    try:
        loop.fit(1)
        message = "not refused"
    except ConfigurationError as error:
        message = str(error)
    save("partial-refused", {"message": message})


def killed_run(directory: Path, label: str, *, kill: bool) -> None:
    """FSDP + TP on (dp=2, tp=2) with sharded (DCP) checkpoints every 2 steps: killed by
    every rank after step 4, or relaunched from its newest checkpoint to the end."""
    mesh = Mesh(dp_shard=2, tp=2)
    extra: tuple[Callback, ...] = (
        Checkpoint(directory / "killed", every_n_steps=2, resume=True),
        *([KillAfterStep(4)] if kill else []))
    run(label, [TensorParallel(plan(), mesh=mesh),
                FSDP(wrap={Block}, mesh=mesh, state_dict="sharded")], batch_size=4, extra=extra)


def main() -> None:
    phase = sys.argv[2]
    directory = out_dir()
    if phase == "tp":
        run("tp", [TensorParallel(plan())], batch_size=8)
        # 40 samples: windows of 16, 16 and a last one of 8 (one micro-batch), whose
        # gradients (plain and DTensor) accumulation rescales to its real size
        run("tp-partial", [TensorParallel(plan())], batch_size=8, samples=40, epochs=1,
            extra=(TensorBoard(directory / "tb", histograms_every_n_epochs=1),))
        # The rates count each sample once: the two ranks of the group read the same ones.
        run("tp-throughput", [TensorParallel(plan())], batch_size=8, epochs=1,
            extra=(ThroughputMonitor(every_n_steps=1, flops_per_sample=6.0, peak_flops=1e9),))
        checkpointing_under_fsdp()
        partial_refused()
        run("tp-killed", [TensorParallel(plan())], batch_size=8,
            extra=(Checkpoint(directory / "tp-checkpoints", every_n_steps=2, resume=True),
                   KillAfterStep(4)))
    elif phase == "tp-resume":
        run("tp-resumed", [TensorParallel(plan())], batch_size=8,
            extra=(Checkpoint(directory / "tp-checkpoints", every_n_steps=2, resume=True),))
    elif phase == "mesh":
        hybrid = Mesh(dp_replicate=2, dp_shard=2)
        run("hsdp", [FSDP(wrap={Block}, mesh=hybrid)], batch_size=2, count=True)
        both = Mesh(dp_shard=2, tp=2)
        run("fsdp-tp", [TensorParallel(plan(), mesh=both), FSDP(wrap={Block}, mesh=both)],
            batch_size=4, count=True,
            extra=(Checkpoint(directory / "full", every_n_epochs=1, keep_last=2),))
        both = Mesh(dp_shard=2, tp=2)
        run("fsdp-tp-sharded", [TensorParallel(plan(), mesh=both),
                                FSDP(wrap={Block}, mesh=both, state_dict="sharded")],
            batch_size=4, epochs=1, extra=(Checkpoint(directory / "sharded"),))
        killed_run(directory, "fsdp-tp-killed", kill=True)  # last: the launch ends here
    elif phase in ("resume-dp4", "resume-one"):
        four = phase == "resume-dp4"
        if four:  # first the killed (dp=2, tp=2) run, relaunched on its own layout
            killed_run(directory, "fsdp-tp-resumed", kill=False)
        for kind, name in (("full", "epoch=0000-step=00000003.pt"),
                           ("sharded", "epoch=0000-step=00000003.dcp")):
            layout: list[Callback] = [FSDP(wrap={Block}, mesh=Mesh(dp_shard=4))] if four else []
            source = Path(directory) / kind / name
            run(f"{phase}-{kind}", layout, batch_size=2 if four else 8, max_steps=4,
                extra=(Checkpoint(Path(directory) / f"{phase}-{kind}", resume=str(source)),))
    else:
        raise SystemExit(f"unknown phase {phase!r}")


if __name__ == "__main__":
    main()
