"""One replica group of a fault-tolerant run, or one rank of the plain DDP run it must equal.

    python ft_train.py ft OUT_DIR [--checkpoint] [--step-sleep S] [--accumulate K]
        [--float64]
        (HOOKLOOP_FT_* set; --accumulate: GradAccumulation(K), in ddp too; --float64: the
        model, data and state in float64, in ddp too)
    torchrun --nproc_per_node=2 ft_train.py hsdp OUT_DIR [--step-sleep S]   (a group of 2)
    torchrun --nproc_per_node=2 ft_train.py ddp OUT_DIR   (or 4: the oracle of hsdp)

``hsdp`` is a replica group of two processes: FSDP inside the group, FaultTolerance across
groups. Writes OUT_DIR/result_<group or rank>.pt (an hsdp group: rank 0's, the weights
whole): the final weights, the final learning rate, (for ft) the ledger and (for ddp) each
step's loss over the global batch and learning rate. An ft group also logs to
OUT_DIR/log.csv and OUT_DIR/tb (every group, the same paths: the writer of each step is
the lowest group of its quorum). ``--step-sleep`` slows each step, so that a test can kill
a group at a random moment, inside the all-reduce or between steps; once OUT_DIR/fast exists
(a kill campaign is over) the steps stop sleeping: no step's arithmetic depends on a sleep.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from hookloop import Callback, Loop
from hookloop.callbacks import (
    DDP, FSDP, Checkpoint, CSVLogger, FaultTolerance, GradAccumulation, LRScheduler,
    TensorBoard)

SAMPLES, BATCH = 48, 4  # 2 groups: 6 steps per epoch
EPOCHS = int(os.environ.get("FT_TEST_EPOCHS", "3"))


class _Slow(Callback):
    """Sleep after the backward (before the step's quorum), and make torchft's all-reduces
    slow (a sleep before each, as a slow network would): a kill at a random moment lands
    between steps or inside an all-reduce, where the peer waits for the victim."""

    def __init__(self, seconds: float, ft: FaultTolerance | None, fast: str) -> None:
        self.seconds, self.ft, self.fast = seconds, ft, fast

    def _sleep(self, seconds: float) -> None:
        # The rest of the run after the test's last kill trains at full speed: the sleeps
        # only make room for kills, and a campaign sized for a busy machine would otherwise
        # sleep through hundreds of steps nobody kills.
        if not os.path.exists(self.fast):
            time.sleep(seconds)

    def on_fit_start(self, loop: Loop) -> None:
        if self.ft is None:
            return
        manager = self.ft.manager
        all_reduce = manager.allreduce

        def slow_all_reduce(*args: object, **kwargs: object) -> object:
            # The test's cue for a kill inside the all-reduce: this group passed the
            # quorum and its peer waits for its part.
            print(f"ft_train: entering the all-reduce at step {loop.state.step}", flush=True)
            self._sleep(self.seconds * 2 / 3)
            return all_reduce(*args, **kwargs)

        manager.allreduce = slow_all_reduce

    def after_backward(self, loop: Loop) -> None:
        self._sleep(self.seconds)


class _GlobalSteps(Callback):
    """Plain DDP's oracle of the logs: per step, the mean of the ranks' losses (the loss of
    the global batch) and the learning rate."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[float, float]] = {}

    def after_step(self, loop: Loop) -> None:
        loss = loop.state.loss.detach().clone()
        torch.distributed.all_reduce(loss)
        self.rows[loop.state.step] = (float(loss) / torch.distributed.get_world_size(),
                                      float(loop.optimizer.param_groups[0]["lr"]))


def main(mode: str, out_dir: str, checkpoint: bool, step_sleep: float,
         accumulate: int = 1) -> None:
    torch.manual_seed(0)
    inputs, targets = torch.randn(SAMPLES, 6), torch.randn(SAMPLES, 1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, targets), batch_size=BATCH, shuffle=True,
        generator=torch.Generator().manual_seed(7))
    schedule = LRScheduler(lambda opt, total: torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=1.0, end_factor=0.1, total_iters=total))
    callbacks: list[Callback] = [schedule]
    ft, oracle = None, _GlobalSteps()
    if mode == "ddp":
        callbacks = [DDP(), *callbacks, oracle]  # the oracle reads the lr after the schedule
        index = int(os.environ["RANK"])
    else:
        ft = FaultTolerance()
        index = ft.group
        callbacks[:0] = [FSDP(state_dict="sharded"), ft] if mode == "hsdp" else [ft]
        callbacks += [CSVLogger(os.path.join(out_dir, "log.csv"), every_n_steps=1),
                      TensorBoard(os.path.join(out_dir, "tb"), every_n_steps=1)]
        if checkpoint and index == 0:  # disk checkpoints come from one group
            callbacks.append(Checkpoint(os.path.join(out_dir, "ckpt"), every_n_steps=2,
                                        resume=True, keep_last=1))
    if step_sleep:
        callbacks.append(_Slow(step_sleep, ft, os.path.join(out_dir, "fast")))
    if accumulate > 1:  # before the schedule, which counts its optimizer steps
        callbacks.insert(callbacks.index(schedule), GradAccumulation(accumulate))
    loop = Loop(model, optimizer, data, loss_fn=torch.nn.functional.mse_loss,
                callbacks=callbacks, device="cpu", sanity_val_batches=0)
    started = time.time()
    loop.fit(EPOCHS)
    weights = {key: value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
               for key, value in loop.unwrapped_model.state_dict().items()}  # hsdp: gathered
    if mode == "hsdp" and int(os.environ["RANK"]) != 0:
        return
    result = {"weights": weights,
              "lr": optimizer.param_groups[0]["lr"], "step": loop.state.step,
              "ledger": ft.ledger if ft else [], "started": started, "ended": time.time(),
              "goodput": ft.goodput.state_dict() if ft else None, "steps": oracle.rows}
    torch.save(result, os.path.join(out_dir, f"result_{index}.pt"))


if __name__ == "__main__":
    arguments = sys.argv[1:]
    sleep = float(arguments[arguments.index("--step-sleep") + 1]) \
        if "--step-sleep" in arguments else 0.0
    windows = int(arguments[arguments.index("--accumulate") + 1]) \
        if "--accumulate" in arguments else 1
    if "--float64" in arguments:  # summation order's drift ~1e-15: a 1e-5 bound is sharp
        torch.set_default_dtype(torch.float64)
    main(arguments[0], arguments[1], "--checkpoint" in arguments, sleep, windows)
