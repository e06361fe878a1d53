"""hookloop's cost per step against a hand-written loop (and Lightning and Ignite) doing the same work.

Every variant trains the same MLP on the same in-memory batches with the same optimizer
(SGD with momentum) for the same number of optimizer steps, on one thread. Each run is a
fresh process (so no variant inherits another's warm caches or allocator), and runs are
interleaved: round 1 runs A B C ..., round 2 starts one further along, and so on, so that a
machine that speeds up or slows down during the benchmark hits every variant alike.

Workloads:

* ``tiny``: MLP 32-64-10, batch 32, 2000 batches. The model costs little, so the loop's
  own cost per step is what shows.
* ``small``: MLP 512-1024-1024-10, batch 128, 300 batches. The model's compute dominates;
  a loop that adds a constant few microseconds disappears in it.

Variants (each compared with the hand-written loop doing the same math):

* ``hand`` / ``hookloop``: forward, loss, backward, ``optimizer.step()``, ``zero_grad``.
* ``hand+clip-accum-cos`` / ``hookloop+clip-accum-cos``: gradient clipping (norm 1.0),
  accumulation over 2 batches and a cosine schedule stepped per optimizer step.
* ``hand+stack`` / ``hookloop+stack``: that, plus autocast to bfloat16 and an EMA of the
  weights (decay 0.999 with warmup): the standard stack.
* ``hookloop+stack+views``: the standard stack with TensorBoard(every_n_steps=50), a
  ProgressBar and a CSVLogger(every_n_steps=50) writing into a fresh folder; compared with
  ``hand+stack``, which has no views.
* ``lightning``, ``ignite`` (and ``+clip-accum-cos``): the same work in PyTorch Lightning
  and PyTorch Ignite, when they are installed (they are not dependencies of hookloop).

Every variant must end on exactly the weights of its hand-written reference (and the same
EMA), and take the same number of optimizer steps: the benchmark fails otherwise, since it
would not be the same work.

Each batch fetch is time-stamped by the data iterable itself, the same way for every
variant, so a step's duration is the time between the fetches that start two consecutive
steps. Reported per variant over the rounds: the median microseconds per step (the whole
pass divided by the steps) with its min-max spread, the median ratio to the reference of
the same round, and the mean of the fastest tenth of the steps (the loop's cost with the
machine's noise mostly gone) with its difference to the reference's. ``fixed ms`` is what
the run costs outside its steps (building the loop, opening and closing files).

The import line is the time of ``python -c "import torch, hookloop"`` over ``python -c
"import torch"`` (whole processes, the median of several, interleaved).

Usage:
    python benchmarks/overhead.py            # the full run (several minutes)
    python benchmarks/overhead.py --quick    # the table's shape, small, in one process
    python benchmarks/overhead.py --rounds 7 --workloads tiny --json results.json
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Settings of the stack variants.
WINDOW = 2          # batches per optimizer step with accumulation
MAX_NORM = 1.0      # gradient clipping
EMA_DECAY = 0.999
LEARNING_RATE = 0.01
MOMENTUM = 0.9
VIEWS_EVERY = 50    # TensorBoard and CSVLogger interval, in steps


@dataclass(frozen=True)
class Workload:
    """A model and its data: layer sizes, batch size, number of batches."""

    name: str
    sizes: tuple[int, ...]
    batch_size: int
    batches: int


WORKLOADS = {
    "tiny": Workload("tiny", (32, 64, 10), 32, 2000),
    "small": Workload("small", (512, 1024, 1024, 10), 128, 300),
}
QUICK_BATCHES = {"tiny": 200, "small": 12}


@dataclass(frozen=True)
class Variant:
    """One way of doing a workload's training: its runner, its reference, its window."""

    name: str
    reference: str
    window: int
    peer: str | None = None  # the module that must be importable for it to run


VARIANTS = [
    Variant("hand", "hand", 1),
    Variant("hookloop", "hand", 1),
    Variant("lightning", "hand", 1, peer="pytorch_lightning"),
    Variant("ignite", "hand", 1, peer="ignite"),
    Variant("hand+clip-accum-cos", "hand+clip-accum-cos", WINDOW),
    Variant("hookloop+clip-accum-cos", "hand+clip-accum-cos", WINDOW),
    Variant("lightning+clip-accum-cos", "hand+clip-accum-cos", WINDOW, peer="pytorch_lightning"),
    Variant("ignite+clip-accum-cos", "hand+clip-accum-cos", WINDOW, peer="ignite"),
    Variant("hand+stack", "hand+stack", WINDOW),
    Variant("hookloop+stack", "hand+stack", WINDOW),
    Variant("hookloop+stack+views", "hand+stack", WINDOW),
]
BY_NAME = {variant.name: variant for variant in VARIANTS}


# --------------------------------------------------------------------------- worker side
class Stamped:
    """The batches, as an iterable that records ``perf_counter()`` at every fetch and at
    the end: every variant's steps are timed by the same few instructions."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = batches
        self.stamps: list[float] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        stamps, clock = self.stamps, time.perf_counter
        for batch in self.batches:
            stamps.append(clock())
            yield batch
        stamps.append(clock())


def make_model(sizes: Sequence[int]) -> Any:
    from torch import nn

    layers: list[nn.Module] = []
    for index, (width_in, width_out) in enumerate(zip(sizes, sizes[1:])):
        if index:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(width_in, width_out))
    return nn.Sequential(*layers)


def make_batches(workload: Workload, batches: int) -> list[Any]:
    import torch

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(batches, workload.batch_size, workload.sizes[0], generator=generator)
    targets = torch.randint(0, workload.sizes[-1], (batches, workload.batch_size),
                            generator=generator)
    return [(inputs[index], targets[index]) for index in range(batches)]


def ema_decay(updates: int) -> float:
    """The decay of EMA update ``updates`` with warmup (the formula of hookloop's EMA)."""
    return min(EMA_DECAY, (1.0 + updates) / (10.0 + updates))


def cosine(optimizer: Any, steps: int) -> Any:
    import torch

    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)


def run_hand(model: Any, optimizer: Any, data: Stamped) -> dict[str, Any]:
    """The plain loop; the epoch's mean loss kept on the device and read once."""
    import torch
    import torch.nn.functional as F

    device = torch.device("cpu")
    model.train()
    losses = []
    steps = 0
    for inputs, targets in data:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = F.cross_entropy(model(inputs), targets)
        losses.append(loss.detach())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
    train_loss = torch.stack(losses).double().mean().item()
    return {"steps": steps, "train_loss": train_loss}


def run_hand_window(model: Any, optimizer: Any, data: Stamped, *, stack: bool) -> dict[str, Any]:
    """Clipping, accumulation and a per-step cosine schedule; with ``stack`` also bf16
    autocast and an EMA of the weights (float32 shadow, one fused lerp per step)."""
    import contextlib

    import torch
    import torch.nn.functional as F

    device = torch.device("cpu")
    scheduler = cosine(optimizer, len(data) // WINDOW)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    sources = [tensor.detach() for tensor in model.state_dict(keep_vars=True).values()]
    shadow = [tensor.detach().clone().float() for tensor in sources] if stack else []
    updates = 0
    model.train()
    losses = []
    steps = 0
    for index, (inputs, targets) in enumerate(data):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if stack
                    else contextlib.nullcontext())
        with autocast:
            loss = F.cross_entropy(model(inputs), targets)
        losses.append(loss.detach())
        (loss / WINDOW).backward()
        if (index + 1) % WINDOW == 0:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            optimizer.step()
            steps += 1
            if stack:
                weight = 1.0 - ema_decay(updates)
                torch._foreach_lerp_(shadow, sources, weight)
                updates += 1
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    train_loss = torch.stack(losses).double().mean().item()
    return {"steps": steps, "train_loss": train_loss, "ema": shadow}


def _hookloop_stack(scratch: str, *, views: bool) -> list[Any]:
    import torch
    from rich.console import Console

    from hookloop.callbacks import (
        AMP,
        EMA,
        CSVLogger,
        GradAccumulation,
        GradClip,
        LRScheduler,
        ProgressBar,
        TensorBoard,
    )

    callbacks = [AMP(torch.bfloat16), GradAccumulation(WINDOW), GradClip(MAX_NORM),
                 EMA(EMA_DECAY), LRScheduler(cosine)]
    if views:
        run = tempfile.mkdtemp(dir=scratch)
        # A console that is not a terminal, as in a log: one line per epoch (plus one a
        # minute); the loss is read for display at most once a minute.
        callbacks += [TensorBoard(run, every_n_steps=VIEWS_EVERY),
                      ProgressBar(console=Console(file=io.StringIO(), force_terminal=False)),
                      CSVLogger(os.path.join(run, "log.csv"), every_n_steps=VIEWS_EVERY)]
    return callbacks


def run_hookloop(model: Any, optimizer: Any, data: Stamped, *, kind: str,
                 scratch: str) -> dict[str, Any]:
    import torch.nn.functional as F

    from hookloop import Loop
    from hookloop.callbacks import EMA, GradAccumulation, GradClip, LRScheduler

    if kind == "bare":
        callbacks: list[Any] = []
    elif kind == "clip-accum-cos":
        callbacks = [GradAccumulation(WINDOW), GradClip(MAX_NORM), LRScheduler(cosine)]
    else:
        callbacks = _hookloop_stack(scratch, views=kind == "stack+views")
    loop = Loop(model, optimizer, data, loss_fn=F.cross_entropy, callbacks=callbacks,
                device="cpu")
    state = loop.fit(1)
    result: dict[str, Any] = {"steps": state.step, "train_loss": state.metrics["train_loss"]}
    emas = [callback for callback in callbacks if isinstance(callback, EMA)]
    if emas:
        result["ema"] = [tensor.detach() for tensor in emas[0].averaged_state_dict().values()]
    return result


def run_lightning(model: Any, optimizer: Any, data: Stamped, *, window: int) -> dict[str, Any]:
    import logging
    import warnings

    import pytorch_lightning as pl
    import torch.nn.functional as F

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs, targets = batch
            return F.cross_entropy(self.model(inputs), targets)

        def configure_optimizers(self) -> Any:
            if window == 1:
                return optimizer
            scheduler = cosine(optimizer, len(data) // window)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    extra: dict[str, Any] = {}
    if window > 1:
        extra = {"gradient_clip_val": MAX_NORM, "accumulate_grad_batches": window}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # barebones: no logging, progress bar, checkpointing or summary (its fastest mode).
        trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, barebones=True,
                             num_sanity_val_steps=0, **extra)
        trainer.fit(Module(), train_dataloaders=data)
    return {"steps": trainer.global_step}


def run_ignite(model: Any, optimizer: Any, data: Stamped, *, window: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from ignite.engine import Engine, Events, create_supervised_trainer

    if window == 1:
        # Ignite's own trainer; the loss is returned as a tensor rather than with .item(),
        # which saves Ignite a read per step.
        trainer = create_supervised_trainer(
            model, optimizer, F.cross_entropy, device="cpu",
            output_transform=lambda inputs, targets, outputs, loss: loss.detach())
        trainer.run(data, max_epochs=1)
        return {"steps": trainer.state.iteration}
    scheduler = cosine(optimizer, len(data) // window)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    counted = {"steps": 0}

    def update(engine: Engine, batch: Any) -> Any:
        model.train()
        inputs, targets = batch
        loss = F.cross_entropy(model(inputs), targets)
        (loss / window).backward()
        if engine.state.iteration % window == 0:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            counted["steps"] += 1
        return loss.detach()

    trainer = Engine(update)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=window),
                              lambda engine: scheduler.step())
    trainer.run(data, max_epochs=1)
    return {"steps": counted["steps"]}


def runner(name: str, scratch: str) -> Callable[[Any, Any, Stamped], dict[str, Any]]:
    base, _, kind = name.partition("+")
    kind = kind or "bare"
    window = WINDOW if kind != "bare" else 1
    if base == "hand":
        if kind == "bare":
            return run_hand
        return lambda m, o, d: run_hand_window(m, o, d, stack=kind == "stack")
    if base == "hookloop":
        return lambda m, o, d: run_hookloop(m, o, d, kind=kind, scratch=scratch)
    if base == "lightning":
        return lambda m, o, d: run_lightning(m, o, d, window=window)
    if base == "ignite":
        return lambda m, o, d: run_ignite(m, o, d, window=window)
    raise SystemExit(f"unknown variant {name!r}")


def preload(names: Sequence[str]) -> None:
    """Import what the variants use before any clock runs: import time is measured apart."""
    import torch.utils.tensorboard  # noqa: F401
    from rich.console import Console  # noqa: F401

    import hookloop.callbacks  # noqa: F401

    if any(name.startswith("lightning") for name in names):
        import pytorch_lightning  # noqa: F401
    if any(name.startswith("ignite") for name in names):
        import ignite.engine  # noqa: F401


def work(workload: Workload, batches: int, names: Sequence[str], out: Path, tag: str) -> None:
    """Run ``names`` one after the other in this process; write one JSON line each."""
    import torch

    torch.set_num_threads(1)
    preload(names)
    data_batches = make_batches(workload, batches)
    scratch = tempfile.mkdtemp(prefix="hookloop-bench-")
    lines = []
    for name in names:
        torch.manual_seed(0)
        model = make_model(workload.sizes)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
        data = Stamped(data_batches)
        start = time.perf_counter()
        result = runner(name, scratch)(model, optimizer, data)
        total = time.perf_counter() - start
        stamps = data.stamps
        window = BY_NAME[name].window
        starts = stamps[::window] if (len(stamps) - 1) % window == 0 else stamps[::window] + stamps[-1:]
        durations = sorted(b - a for a, b in zip(starts, starts[1:]))
        tenth = durations[:max(1, len(durations) // 10)]
        weights = out / f"{tag}-{name}.pt"
        torch.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "ema": result.get("ema", [])}, weights)
        lines.append({
            "variant": name, "tag": tag, "steps": result["steps"], "batches": len(data_batches),
            "seconds_per_step": (stamps[-1] - stamps[0]) / max(1, result["steps"]),
            "fastest_tenth": statistics.fmean(tenth),
            "fixed": total - (stamps[-1] - stamps[0]),
            "weights": str(weights),
        })
    for line in lines:
        print(json.dumps(line), flush=True)


# --------------------------------------------------------------------------- parent side
def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    return env


Job = tuple[str, int, list[str], str]  # workload, batches, variants in order, tag


def spawn(jobs: Sequence[Job], out: Path) -> list[dict[str, Any]]:
    """Run ``jobs`` in one fresh process; their results, one per variant run."""
    command = [sys.executable, __file__, "--worker", json.dumps(jobs), "--out", str(out)]
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                            timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"worker {jobs} failed:\n{result.stderr[-4000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def same_weights(first: str, second: str) -> tuple[bool, float]:
    """Exactly equal weights and EMA? With the largest absolute difference."""
    import torch

    a, b = torch.load(first, weights_only=True), torch.load(second, weights_only=True)
    tensors_a = list(a["model"].values()) + list(a["ema"])
    tensors_b = list(b["model"].values()) + list(b["ema"])
    if len(tensors_a) != len(tensors_b):
        return False, float("inf")
    largest = max((float((x.double() - y.double()).abs().max()) for x, y in zip(tensors_a,
                                                                                tensors_b)),
                  default=0.0)
    return largest == 0.0, largest


def import_times(runs: int) -> dict[str, float]:
    """Median whole-process seconds of ``import torch`` and of torch plus each library."""
    statements = {"torch": "import torch", "hookloop": "import torch, hookloop"}
    if importlib.util.find_spec("pytorch_lightning") is not None:
        statements["lightning"] = "import torch, pytorch_lightning"
    if importlib.util.find_spec("ignite") is not None:
        statements["ignite"] = "import torch, ignite.engine"
    # An installed wheel holds compiled bytecode (pip compiles it), as torch's and the peers'
    # installs do; an editable checkout under PYTHONDONTWRITEBYTECODE would compile every
    # module of hookloop in every process instead. Compile once, as pip would.
    import compileall

    import hookloop

    compileall.compile_dir(str(Path(hookloop.__file__).parent), quiet=1)
    times: dict[str, list[float]] = {name: [] for name in statements}
    for _ in range(runs):
        for name, statement in statements.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", statement], env=child_env(), check=True)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def available(variant: Variant, peers: bool) -> bool:
    if variant.peer is None:
        return True
    return peers and importlib.util.find_spec(variant.peer) is not None


def summarize(rows: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per variant: medians over rounds, ratios and differences to the same round's reference."""
    table = []
    for name, runs in rows.items():
        reference = rows[BY_NAME[name].reference]
        ratios = [run["seconds_per_step"] / ref["seconds_per_step"]
                  for run, ref in zip(runs, reference)]
        deltas = [run["fastest_tenth"] - ref["fastest_tenth"] for run, ref in zip(runs, reference)]
        per_step = [run["seconds_per_step"] for run in runs]
        table.append({
            "variant": name, "reference": BY_NAME[name].reference, "steps": runs[0]["steps"],
            "median_us": statistics.median(per_step) * 1e6, "min_us": min(per_step) * 1e6,
            "max_us": max(per_step) * 1e6, "ratio": statistics.median(ratios),
            "fastest_tenth_us": statistics.median(run["fastest_tenth"] for run in runs) * 1e6,
            "over_reference_us": statistics.median(deltas) * 1e6,
            "fixed_ms": statistics.median(run["fixed"] for run in runs) * 1e3,
            "same_weights": all(run["same_weights"] for run in runs),
            "largest_difference": max(run["largest_difference"] for run in runs),
        })
    return table


def print_table(workload: str, table: list[dict[str, Any]]) -> None:
    print(f"\n### {workload}\n")
    print("| variant | steps | us/step (median) | min-max | ratio | fastest 10% us/step "
          "| over reference | fixed ms | same weights |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in table:
        own = row["variant"] == row["reference"]
        ratio = "1.000" if own else f"{row['ratio']:.3f}"
        over = "(reference)" if own else f"{row['over_reference_us']:+.1f} us"
        same = "yes" if row["same_weights"] else f"NO ({row['largest_difference']:.2e})"
        print(f"| {row['variant']} | {row['steps']} | {row['median_us']:.1f} | "
              f"{row['min_us']:.1f}-{row['max_us']:.1f} | {ratio} | "
              f"{row['fastest_tenth_us']:.1f} | {over} | {row['fixed_ms']:.1f} | {same} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="few batches, 2 rounds, all in one process: the table's shape")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5; quick 2)")
    parser.add_argument("--workloads", default="tiny,small")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variants (default: all that can run)")
    parser.add_argument("--no-peers", action="store_true", help="skip Lightning and Ignite")
    parser.add_argument("--import-runs", type=int, default=None,
                        help="processes per import measurement (default 7; quick 2)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per batch with valgrind's callgrind instead "
                             "of timing (tiny workload; see benchmarks/instructions.py)")
    parser.add_argument("--warmup", type=int, default=50,
                        help="instruction mode: batches before the counted ones")
    parser.add_argument("--count", type=int, default=200,
                        help="instruction mode: batches counted")
    parser.add_argument("--callgrind-dir", default=None,
                        help="instruction mode: keep callgrind's files here (one per variant, "
                             "in the order run) for callgrind_annotate")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # jobs, as JSON
    parser.add_argument("--count-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker is not None:
        for workload, batches, names, tag in json.loads(args.worker):
            work(WORKLOADS[workload], batches, names, Path(args.out), tag)
        return 0
    if args.count_worker is not None:
        import instructions
        instructions.count_worker(json.loads(args.count_worker), args.warmup, args.count,
                                  Path(args.out))
        return 0
    if args.instructions:
        import instructions
        if args.warmup % WINDOW or args.count % WINDOW:
            parser.error(f"--warmup and --count must be multiples of {WINDOW} (the window)")
        names = args.variants.split(",") if args.variants else None
        if args.no_peers:
            names = [name for name in names or instructions.ORDER
                     if name not in instructions.PEERS]
        unknown = [name for name in names or () if name not in instructions.REFERENCE]
        if unknown:
            parser.error(f"unknown variants {unknown}; known: {instructions.ORDER}")
        return instructions.main(names, args.warmup, args.count, args.json, args.callgrind_dir)

    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    names = args.variants.split(",") if args.variants else [variant.name for variant in VARIANTS]
    unknown = [name for name in names if name not in BY_NAME]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(BY_NAME)}")
    selected = [BY_NAME[name] for name in names if available(BY_NAME[name], not args.no_peers)]
    for variant in list(selected):  # every variant needs its reference in the same rounds
        if variant.reference not in [chosen.name for chosen in selected]:
            selected.insert(0, BY_NAME[variant.reference])
    skipped = [name for name in names if name not in [variant.name for variant in selected]]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    import torch

    print(f"hookloop overhead benchmark: {'quick' if args.quick else 'full'}, {rounds} rounds, "
          f"python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, one thread, load average {load:.2f} at start")
    if skipped:
        print(f"not run (not installed): {', '.join(skipped)}")
    results: dict[str, Any] = {"rounds": rounds, "quick": args.quick, "load_start": load,
                               "workloads": {}}
    failed = False
    with tempfile.TemporaryDirectory(prefix="hookloop-overhead-") as directory:
        out = Path(directory)
        jobs: list[Job] = []
        for workload_name in args.workloads.split(","):
            batches = (QUICK_BATCHES[workload_name] if args.quick
                       else WORKLOADS[workload_name].batches)
            for round_index in range(rounds):
                shift = round_index % len(selected)
                order = [variant.name for variant in selected[shift:] + selected[:shift]]
                jobs.append((workload_name, batches, order, f"{workload_name}-{round_index}"))
        if args.quick:  # the table's shape in seconds: one process for everything
            found = spawn(jobs, out)
        else:  # every run in a fresh process
            found = [line for workload_name, batches, order, tag in jobs for name in order
                     for line in spawn([(workload_name, batches, [name], tag)], out)]
        for workload_name in args.workloads.split(","):
            workload = WORKLOADS[workload_name]
            batches = QUICK_BATCHES[workload_name] if args.quick else workload.batches
            rows: dict[str, list[dict[str, Any]]] = {variant.name: [] for variant in selected}
            for round_index in range(rounds):
                tag = f"{workload_name}-{round_index}"
                by_variant = {line["variant"]: line for line in found if line["tag"] == tag}
                for variant in selected:
                    line = by_variant[variant.name]
                    reference = by_variant[variant.reference]
                    expected = batches // variant.window
                    if line["steps"] != expected:
                        raise SystemExit(f"{variant.name} took {line['steps']} optimizer steps "
                                         f"on {workload_name}, not {expected}: not the same work")
                    same, largest = same_weights(line["weights"], reference["weights"])
                    line["same_weights"], line["largest_difference"] = same, largest
                    failed = failed or not same
                    rows[variant.name].append(line)
            table = summarize(rows)
            results["workloads"][workload_name] = {"batches": batches, "table": table,
                                                   "runs": rows}
            print_table(f"{workload_name}: MLP {'-'.join(map(str, workload.sizes))}, batch "
                        f"{workload.batch_size}, {batches} batches", table)
    imports = import_times(args.import_runs or (2 if args.quick else 7))
    results["imports"] = imports
    print("\n### import (whole process, median)\n")
    print(f"import torch: {imports['torch'] * 1e3:.0f} ms; over it: " + ", ".join(
        f"{name} {(seconds - imports['torch']) * 1e3:+.0f} ms"
        for name, seconds in imports.items() if name != "torch"))
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results["load_end"] = load_end
    print(f"\nload average at the end: {load_end:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if failed:
        print("FAILED: a variant did not end on its reference's weights (see 'same weights')")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
