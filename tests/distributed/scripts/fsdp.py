"""torchrun script: FSDP (fully_shard, gloo) against the oracles of
tests/distributed/test_fsdp_two_processes.py.

Usage: torchrun --nproc_per_node=N fsdp.py OUT_DIR PHASE

PHASE:
  train       the equivalence runs (accumulation 1 and 2 with clipping, validation sets
              that split evenly and not; EMA over the shards validating with its weights),
              accumulation 4 with every reduce-scatter counted,
              a full checkpoint loaded into an unsharded model, bf16 and fp16 precision,
              and the uninterrupted reference of the resume phases
  kill-full   a run with Checkpoint(state_dict="full") SIGKILLed by both ranks mid-epoch
  resume-full-kill-sharded   the full run resumed to its end; then a sharded run
              SIGKILLed by both ranks while it writes its second checkpoint
  kill-async  a sharded run with Checkpoint(async_save=True) SIGKILLed after step 5
  resume-sharded   the sharded run resumed (from its first checkpoint) to its end; then
              the async run resumed to its end
  one-rank    (1 process) one step from a copy of the sharded run's first checkpoint
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from common import FEATURES, out_dir, rank, regression_data, save, shuffled_loader
from torch import nn
from torch.utils.data import DataLoader

from hookloop import Callback, Loop, load_checkpoint
from hookloop.callbacks import AMP, EMA, FSDP, Checkpoint, GradAccumulation, GradClip

MAX_NORM = 0.5


def make_model(seed: int) -> nn.Module:
    """Three Linear blocks whose parameters split unevenly over two ranks (16, 16, 1 rows)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay on the weights, none on the biases: groups in an order unlike
    the model's, which FSDP must keep when it re-points the optimizer."""
    weights = [param for name, param in model.named_parameters() if name.endswith("weight")]
    biases = [param for name, param in model.named_parameters() if name.endswith("bias")]
    return torch.optim.AdamW([{"params": biases[::-1], "weight_decay": 0.0},
                              {"params": weights, "weight_decay": 0.1}], lr=0.01)


def gathered(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights on every rank (each DTensor gathered: a collective)."""
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()
            .clone() for name, value in module.state_dict().items()}


class StepLog(Callback):
    """Per optimizer step: this rank's loss of the step's last batch and the grad norm."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.norms: dict[int, float] = {}
        self.metrics: list[dict[str, float]] = []

    def after_step(self, loop: Loop) -> None:
        self.losses[loop.state.step] = loop.state.loss.item()
        if loop.state.grad_norm is not None:
            self.norms[loop.state.step] = float(loop.state.grad_norm)

    def on_epoch_end(self, loop: Loop) -> None:
        self.metrics.append(dict(loop.state.metrics))


# ------------------------------------------------------------------------- train
def equivalence(accumulation: int, val_samples: int) -> None:
    """Ordered batches of 4 per rank (8 a global step), clipping active."""
    model = make_model(seed=3)
    log = StepLog()
    train = DataLoader(regression_data(48, seed=1), batch_size=4)
    val = DataLoader(regression_data(val_samples, seed=2), batch_size=4)
    loop = Loop(model, make_optimizer(model), train, val_data=val,
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[FSDP(), GradAccumulation(accumulation), GradClip(MAX_NORM), log])
    loop.fit(2)
    weights = gathered(model)
    if rank() == 0:
        save(f"weights-accumulation{accumulation}", weights)
    save(f"log-accumulation{accumulation}", {"norms": log.norms, "metrics": log.metrics,
                                             "parameter": type(model[0].weight).__name__})


def ema_validation() -> None:
    """EMA over the shards, validating with its weights over 9 samples (5 + 4: the model is
    gathered for the pass, after the EMA weights were swapped into the shards)."""
    model = make_model(seed=3)
    ema = EMA(0.5)
    log = StepLog()
    train = DataLoader(regression_data(48, seed=1), batch_size=4)
    val = DataLoader(regression_data(9, seed=2), batch_size=4)
    loop = Loop(model, make_optimizer(model), train, val_data=val,
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=[FSDP(), ema, log])
    loop.fit(2)
    shadow = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
              for name, value in ema.averaged_state_dict().items()}
    if rank() == 0:
        save("ema-shadow", shadow)
    save("ema-metrics", log.metrics)


def reduce_scatters() -> None:
    """Accumulation 4: reduce-scatters counted by wrapping torch.distributed's
    reduce_scatter_single, which FSDP2's default reduce-scatter calls; and, as a control
    that the count sees them all, the same run with the gradient sync left on."""

    class SyncAlways(FSDP):
        def train_step_context(self, loop: Loop) -> None:
            return None  # never set_requires_gradient_sync(False): every backward reduces

    counts: dict[str, Any] = {}
    for label, callback in (("skipping", FSDP()), ("control", SyncAlways())):
        calls = [0]
        original = dist.reduce_scatter_single

        def counted(*args: Any, _calls: list[int] = calls, _original: Any = original,
                    **kwargs: Any) -> Any:
            _calls[0] += 1
            return _original(*args, **kwargs)

        per_step: list[int] = []

        class PerStep(Callback):
            def after_step(self, loop: Loop, _calls: list[int] = calls,
                           _steps: list[int] = per_step) -> None:
                _steps.append(_calls[0] - sum(_steps))

        model = make_model(seed=3)
        train = DataLoader(regression_data(48, seed=1), batch_size=4)  # 6 batches: windows 4, 2
        loop = Loop(model, make_optimizer(model), train, loss_fn=nn.functional.mse_loss,
                    device="cpu", callbacks=[callback, GradAccumulation(4), PerStep()])
        dist.reduce_scatter_single = counted  # type: ignore[assignment]
        try:
            loop.fit(2)
        finally:
            dist.reduce_scatter_single = original  # type: ignore[assignment]
        groups = sum(1 for module in model.modules()
                     if type(module).__name__.startswith("FSDP") and any(
                         True for _ in module.parameters(recurse=False)))
        counts[label] = {"per_step": per_step, "groups": groups, "steps": loop.state.step}
    save("reduce-scatters", counts)


def full_file_into_unsharded_model() -> None:
    model = make_model(seed=5)
    directory = out_dir() / "full-file"
    train = DataLoader(regression_data(16, seed=1), batch_size=4)
    loop = Loop(model, make_optimizer(model), train, loss_fn=nn.functional.mse_loss,
                device="cpu", callbacks=[FSDP(state_dict="full"), Checkpoint(directory)])
    loop.fit(1)
    weights = gathered(model)
    if rank() == 0:
        plain = make_model(seed=11)  # other initial weights: the file must overwrite them all
        load_checkpoint(directory / "epoch=0000-step=00000002.pt", plain)
        save("full-file", {"equal": all(torch.equal(value, weights[name])
                                        for name, value in plain.state_dict().items()),
                           "keys": sorted(plain.state_dict()) == sorted(weights)})


def precision() -> None:
    """bf16 through FSDP's policy, fp16 through AMP with the sharded GradScaler."""
    results: dict[str, Any] = {}
    for label, callbacks in (("bf16-policy", [FSDP(mixed_precision=torch.bfloat16)]),
                             ("fp16-amp", [FSDP(), AMP(torch.float16,
                                                       scaler={"init_scale": 2.0 ** 4})])):
        model = make_model(seed=3)
        log = StepLog()
        train = DataLoader(regression_data(32, seed=1), batch_size=4)
        loop = Loop(model, make_optimizer(model), train, loss_fn=nn.functional.mse_loss,
                    device="cpu", callbacks=[*callbacks, log])
        loop.fit(1)
        results[label] = {"steps": loop.state.step, "losses": list(log.losses.values()),
                          "scaler": type(loop.scaler).__name__ if loop.scaler else None}
    save("precision", results)


# ------------------------------------------------------------------------ resume
STEPS_PER_EPOCH = 8  # 64 samples, 4 per rank and batch


def resume_run(directory: str, layout: str, *, epochs: int = 2, batch_size: int = 4,
               kill_after_step: int | None = None, kill_in_save_at: int | None = None,
               max_steps: int | None = None, async_save: bool = False, label: str) -> None:
    model = make_model(seed=7)
    log = StepLog()
    ema = EMA(0.9)
    train = shuffled_loader(regression_data(64, seed=8), batch_size, seed=9)
    callbacks: list[Callback] = [FSDP(state_dict=layout), GradClip(MAX_NORM), ema,
                                 Checkpoint(directory, every_n_steps=2, resume=True,
                                            async_save=async_save), log]
    if kill_after_step is not None:
        callbacks.append(KillAfterStep(kill_after_step))
    if kill_in_save_at is not None:
        kill_inside_sharded_save(kill_in_save_at)
    loop = Loop(model, make_optimizer(model), train, loss_fn=nn.functional.mse_loss,
                device="cpu", callbacks=callbacks)
    loop.fit(epochs, max_steps=max_steps)
    shadow = ema.averaged_state_dict()
    shadow = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value)
              for name, value in shadow.items()}
    weights = gathered(model)
    if rank() == 0:
        save(f"{label}-weights", weights)
        save(f"{label}-ema", shadow)
    save(f"{label}-log", {"losses": log.losses})


class KillAfterStep(Callback):
    """SIGKILL of this rank at the end of optimizer step ``step`` (after Checkpoint ran)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step_boundary and loop.state.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_inside_sharded_save(step: int) -> None:
    """SIGKILL of this rank once DCP wrote every rank's shards of the checkpoint of ``step``,
    before rank 0 writes hookloop.pt and renames the directory."""
    import torch.distributed.checkpoint as dcp

    original = dcp.save

    def save_then_die(state: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(state, *args, **kwargs)
        if _saving_step(state) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dcp.save = save_then_die  # type: ignore[assignment]


def _saving_step(state: dict[str, Any]) -> int:
    """The optimizer step of the state being saved: AdamW's step count of a parameter."""
    steps = [entry["step"] for entry in state["optimizer"]["state"].values()]
    return int(steps[0])


def main() -> None:
    phase = sys.argv[2]
    directory = out_dir()
    if phase == "train":
        equivalence(accumulation=1, val_samples=9)   # 5 + 4 samples: the gathered path
        equivalence(accumulation=2, val_samples=8)   # 4 + 4 samples: the sharded path
        ema_validation()
        reduce_scatters()
        full_file_into_unsharded_model()
        precision()
        resume_run(str(directory / "reference"), "full", label="reference")
    elif phase == "kill-full":
        resume_run(str(directory / "full"), "full", kill_after_step=5, label="killed")
    elif phase == "resume-full-kill-sharded":
        resume_run(str(directory / "full"), "full", label="resumed-full")
        resume_run(str(directory / "sharded"), "sharded", kill_in_save_at=6, label="killed")
    elif phase == "kill-async":
        resume_run(str(directory / "async"), "sharded", async_save=True, kill_after_step=5,
                   label="killed")
    elif phase == "resume-sharded":
        resume_run(str(directory / "sharded"), "sharded", label="resumed-sharded")
        resume_run(str(directory / "async"), "sharded", async_save=True, label="resumed-async")
    elif phase == "one-rank":
        resume_run(str(directory / "sharded-copy"), "sharded", batch_size=8, max_steps=5,
                   label="one-rank")
    else:
        raise SystemExit(f"unknown phase {phase!r}")


if __name__ == "__main__":
    main()
