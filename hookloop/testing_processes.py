"""The checks of the callback test kit (`hookloop.testing`) that run in other processes:
a fit killed with SIGKILL right after a step (``check_resume(relaunch=True)``), and the
kit's fit on 2 ranks under torchrun (`check_ranks`). Users import them from
`hookloop.testing`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hookloop.base.comparison import difference
from hookloop.testing_run import EPOCHS, Factory, KitFailure, folder

__all__ = ["check_ranks", "killed_launch"]

_CHILD = r'''
import importlib, os, signal, sys
sys.path[:0] = {path}
from hookloop import Callback
from hookloop import testing_run as kit
module = importlib.import_module({module!r})
factory = module
for part in {qualname!r}.split("."):
    factory = getattr(factory, part)
stop_at = {stop_at}

class Kill(Callback):
    def on_batch_end(self, loop):
        if loop.state.step == stop_at and loop.optimizer_stepped:
            os.kill(os.getpid(), signal.SIGKILL)

made = kit.make(factory, {where!r})
loop = kit.standard_loop(kit.as_list(made), {where!r}, seed={seed})
loop.callbacks.append(Kill())  # after the checkpoint of the step: killed once it is written
kit.quiet_fit(loop, {epochs})
'''


def _importable(factory: Factory) -> tuple[str, str]:
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or "<" in qualname or module == "__main__":
        raise KitFailure(f"{factory!r} must be a module-level function or class (another "
                         "process imports it) for relaunch=True and check_ranks")
    return module, qualname


def _child_environment() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *sys.path])
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def killed_launch(factory: Factory, where: str, seed: int, stop_at: int) -> None:
    module, qualname = _importable(factory)
    script = _CHILD.format(path=json.dumps([p for p in sys.path if p]), module=module,
                           qualname=qualname, stop_at=stop_at, where=where, seed=seed,
                           epochs=EPOCHS)
    result = subprocess.run([sys.executable, "-c", "import torch; torch.set_num_threads(1)\n"
                             + script], env=_child_environment(), capture_output=True,
                            text=True, timeout=600)
    if result.returncode != -9:
        raise KitFailure(f"the interrupted launch should have been killed after step "
                         f"{stop_at}; it exited with {result.returncode}:\n"
                         f"{result.stderr[-3000:]}")


def check_ranks(factory: Factory, directory: str | os.PathLike[str] | None = None, *,
                timeout: float = 300) -> None:
    """Under torchrun with 2 processes (gloo, CPU): every rank makes the same decisions
    with the callback in the standard stack under `DDP`: the same weights, steps, stop
    (and its reason), ``loop.state.metrics`` and callback state.

    Raises:
        KitFailure: the ranks disagree (naming the first difference), or a rank failed.
    """
    module, qualname = _importable(factory)
    with folder(directory) as root:
        script = Path(root, "ranks.py")
        script.write_text(_RANKS.format(path=json.dumps([p for p in sys.path if p]),
                                        module=module, qualname=qualname, root=root),
                          encoding="utf-8")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=2", str(script)]
        env = _child_environment()
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as error:
            # torchrun starts each rank in a session of its own: only torchrun can end them
            # (SIGTERM, then SIGKILL after its grace), so a SIGKILL to it would orphan them.
            process.terminate()
            process.communicate()
            raise KitFailure(f"the 2 ranks did not finish in {timeout} s (a hang: a "
                             "decision one rank made alone?)") from error
        if process.returncode != 0:
            raise KitFailure("a rank failed under torchrun (ranks that decide differently "
                             f"break the collectives):\n{output[-3000:]}")
        ranks = [torch.load(Path(root, f"rank{rank}.pt"), weights_only=True) for rank in (0, 1)]
        found = difference(ranks[1], ranks[0])
        if found:
            raise KitFailure(f"rank 1 decided differently from rank 0: {found}")


_RANKS = r'''
import contextlib, importlib, io, os, sys
sys.path[:0] = {path}
import torch
torch.set_num_threads(1)
from hookloop import testing_run as kit
from hookloop.callbacks import DDP
module = importlib.import_module({module!r})
factory = module
for part in {qualname!r}.split("."):
    factory = getattr(factory, part)
rank = int(os.environ["RANK"])
work = os.path.join({root!r}, f"work{{rank}}")
made = kit.make(factory, work)
loop = kit.standard_loop([DDP()] + kit.as_list(made), work, checkpoint=False)
with contextlib.redirect_stdout(io.StringIO()):
    loop.fit(3)
own = [c for c in kit.as_list(made) if not c.rank_zero_only]
torch.save({{"weights": kit.weights(loop), "step": loop.state.step,
             "stopped": loop.stop_requested, "reason": loop.stop_reason or "",
             "epoch": loop.state.epoch,
             "metrics": {{k: float(v) for k, v in loop.state.metrics.items()}},
             "state": kit.states(own)}}, os.path.join({root!r}, f"rank{{rank}}.pt"))
'''
