"""The instruction mode of ``benchmarks/overhead.py``: instructions per training step,
counted by valgrind's callgrind, which a loaded machine cannot blur.

How the region is exact. The worker runs under
``valgrind --tool=callgrind --instr-atstart=no --dump-before=sys_getswitchinterval
--dump-before=sys_getallocatedblocks``: imports run uninstrumented (fast), then the worker
switches instrumentation on once (``callgrind_control -i on`` on its own pid, waiting for
the answer). Every variant's data iterable (`Marked`) calls ``sys.getswitchinterval()``
right before it hands out batch ``warmup`` and ``sys.getallocatedblocks()`` right before
it hands out batch ``warmup + count``; callgrind writes the counters to a file, and starts
them afresh, when either C function is entered. The dumps the second one makes are kept:
each holds exactly the instructions of ``count`` training batches after ``warmup``, from
one fetch to the fetch ``count`` batches later, of every thread. The region opens with a
dump, not with ``--zero-before``: callgrind's zeroing clears only the counters of the
thread that enters the function, so a background thread (tensorboard's event writer) would
bring into the region all it did before it (its event file's first records, the hparams
session start among them, checksummed in Python: millions of instructions). Those two C
functions are called by nothing else during training (the worker checks that it got one
dump per variant). The marker calls are the same few instructions in every variant; a loop
that fetches a batch ahead (Lightning) moves the region by a batch, not its length.

Variants (each ends on its reference's weights, checked in the worker with torch.equal):

* ``hand``, ``hookloop``, ``ignite``, ``torchtnt``, ``lightning`` (the peers when installed):
  the bare loop.
* ``hookloop+listen10``, ``hookloop+listen50``: 10 or 50 callbacks that listen to every
  per-batch event and do nothing: the cost of dispatch, per listening callback.
* ``hand+stack`` / ``hookloop+stack``: AMP(bf16), accumulation over 2, clipping, EMA and a
  cosine schedule; ``hand+stack+views`` / ``hookloop+stack+views``: with TensorBoard and
  CSV every 50 steps and a progress line per epoch (by hand: a SummaryWriter, a csv
  writer, a print).

The worker-stamp line: what a DataLoader worker adds to each batch it makes (`WorkerStamp`:
reading its generators' states, and pickling them with the batch for the worker's queue:
a stamped collate pickled, minus the same collate pickled alone), in a worker's steady
state (its first, whole stamp is not counted), over the instructions of making a cheap
batch of 32 samples (32 ``__getitem__`` of a map-style dataset that returns a small tensor
pair, collated by torch's ``default_collate``), all counted in this process the same way;
and the stamp of a dataset that draws from Python's and NumPy's generators at every batch
(their states then travel in full). Python's garbage collector is off in these regions (a
collection of the whole heap landing in one of them would be counted as its cost).
"""

from __future__ import annotations

import gc
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import overhead as bench

ZERO, DUMP = "sys_getswitchinterval", "sys_getallocatedblocks"
PEERS = {"ignite": "ignite.engine", "torchtnt": "torchtnt.framework",
         "lightning": "pytorch_lightning"}
REFERENCE = {"hand": "hand", "hookloop": "hand", "ignite": "hand", "torchtnt": "hand",
             "lightning": "hand", "hookloop+listen10": "hand", "hookloop+listen50": "hand",
             "hand+stack": "hand+stack", "hookloop+stack": "hand+stack",
             "hand+stack+views": "hand+stack", "hookloop+stack+views": "hand+stack"}
ORDER = list(REFERENCE)
STAMP_ROUNDS = 50


class Marked:
    """The batches, as an iterable that opens the counted region right before it hands out
    batch ``first`` and closes it right before batch ``first + count``."""

    def __init__(self, batches: Sequence[Any], first: int, count: int) -> None:
        self.batches, self.first, self.last = batches, first, first + count
        assert self.last < len(batches), "the region must end before the data does"

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        first, last = self.first, self.last
        start, stop = sys.getswitchinterval, sys.getallocatedblocks
        for index, batch in enumerate(self.batches):
            if index == first:
                start()
            elif index == last:
                stop()
            yield batch


def listeners(count: int) -> list[Any]:
    """``count`` callbacks that listen to every per-batch event of a step and do nothing."""
    from hookloop import Callback

    class Listen(Callback):
        def on_batch_start(self, loop: Any) -> None:
            pass

        def after_forward(self, loop: Any) -> None:
            pass

        def after_backward(self, loop: Any) -> None:
            pass

        def before_step(self, loop: Any) -> None:
            pass

        def after_step(self, loop: Any) -> None:
            pass

        def on_batch_end(self, loop: Any) -> None:
            pass

    made = []
    for index in range(count):
        listen = Listen()
        listen.name = f"listen{index}"
        made.append(listen)
    return made


def run_hookloop_listening(model: Any, optimizer: Any, data: Any, count: int) -> dict[str, Any]:
    import torch.nn.functional as F

    from hookloop import Loop

    loop = Loop(model, optimizer, data, loss_fn=F.cross_entropy, callbacks=listeners(count),
                device="cpu")
    return {"steps": loop.fit(1).step}


def run_hand_views(model: Any, optimizer: Any, data: Any, scratch: str) -> dict[str, Any]:
    """The standard stack by hand, with the views by hand: a SummaryWriter and CSV rows
    every ``VIEWS_EVERY`` optimizer steps (loss read then), a progress line per epoch."""
    import contextlib
    import csv
    import io

    import torch
    import torch.nn.functional as F
    from torch.utils.tensorboard import SummaryWriter

    run = tempfile.mkdtemp(dir=scratch)
    writer = SummaryWriter(run)
    rows: list[tuple[int, torch.Tensor, float]] = []
    printed = io.StringIO()
    scheduler = bench.cosine(optimizer, len(data) // bench.WINDOW)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    sources = [tensor.detach() for tensor in model.state_dict(keep_vars=True).values()]
    shadow = [tensor.detach().clone().float() for tensor in sources]
    model.train()
    losses, steps = [], 0
    for index, (inputs, targets) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(inputs), targets)
        losses.append(loss.detach())
        (loss / bench.WINDOW).backward()
        if (index + 1) % bench.WINDOW == 0:
            torch.nn.utils.clip_grad_norm_(params, bench.MAX_NORM)
            optimizer.step()
            steps += 1
            torch._foreach_lerp_(shadow, sources, 1.0 - bench.ema_decay(steps - 1))
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if steps % bench.VIEWS_EVERY == 0:
                lr = optimizer.param_groups[0]["lr"]
                writer.add_scalar("step/loss", loss.item(), steps)
                writer.add_scalar("step/lr", lr, steps)
                rows.append((steps, loss.detach(), lr))
    train_loss = torch.stack(losses).double().mean().item()
    with open(os.path.join(run, "log.csv"), "w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(["step", "loss", "lr"])
        out.writerows((step, value.item(), lr) for step, value, lr in rows)
    writer.add_scalar("metrics/train_loss", train_loss, steps)
    with contextlib.redirect_stdout(printed):
        print(f"epoch 1/1  step {steps}  train_loss {train_loss:.4g}")
    writer.close()
    return {"steps": steps, "ema": shadow}


def run_torchtnt(model: Any, optimizer: Any, data: Any) -> dict[str, Any]:
    import torch.nn.functional as F
    from torchtnt.framework.state import State
    from torchtnt.framework.train import train
    from torchtnt.framework.unit import TrainUnit

    class Unit(TrainUnit[Any]):
        def train_step(self, state: State, batch: Any) -> Any:
            inputs, targets = batch
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

    unit = Unit()
    model.train()
    train(unit, data, max_epochs=1)
    return {"steps": unit.train_progress.num_steps_completed}


def run_variant(name: str, model: Any, optimizer: Any, data: Any, scratch: str) -> dict[str, Any]:
    if name.startswith("hookloop+listen"):
        return run_hookloop_listening(model, optimizer, data, int(name.removeprefix(
            "hookloop+listen")))
    if name == "hand+stack+views":
        return run_hand_views(model, optimizer, data, scratch)
    if name == "torchtnt":
        return run_torchtnt(model, optimizer, data)
    return bench.runner(name, scratch)(model, optimizer, data)


def window_of(name: str) -> int:
    return bench.WINDOW if "+stack" in name else 1


# --------------------------------------------------------------------------- worker side
def instrument_on() -> None:
    """Switch callgrind's instrumentation on in this process and wait until it is."""
    ask = subprocess.Popen(["callgrind_control", "-i", "on", str(os.getpid())],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while ask.poll() is None:  # keep running Python: callgrind answers between blocks
        if time.monotonic() > deadline:
            ask.kill()
            raise SystemExit("callgrind_control -i on got no answer")
    output = ask.stdout.read() if ask.stdout else ""
    if ask.returncode != 0 or "OK" not in output:
        raise SystemExit(f"callgrind_control -i on failed: {output}")


def stamp_regions() -> list[str]:
    """Count, `STAMP_ROUNDS` times each, as regions: making a cheap batch; the worker's
    stamp (`WorkerStamp` over a collate, pickled as the worker's queue pickles it) and the
    same collate pickled alone; and the stamp again when the dataset draws from Python's
    and NumPy's generators at every batch (those states then travel in full)."""
    import pickle
    import random

    import numpy
    import torch
    from torch.utils.data import Dataset, default_collate

    from hookloop.engine.resumable import WorkerStamp

    class Cheap(Dataset):
        def __init__(self) -> None:
            self.inputs = torch.randn(4096, 8)

        def __len__(self) -> int:
            return 4096

        def __getitem__(self, index: int) -> Any:
            return self.inputs[index], index % 10

    dataset, stamp, indices = Cheap(), WorkerStamp(default_collate), list(range(32))
    samples = [dataset[i] for i in indices]

    def draw() -> None:
        random.random()
        numpy.random.random()

    regions = {
        "stamp:batch": lambda: default_collate([dataset[i] for i in indices]),
        "stamp:stamp": lambda: pickle.dumps(stamp(samples)),
        "stamp:collate": lambda: pickle.dumps(default_collate(samples)),
        "stamp:stamp-drawing": lambda: (draw(), pickle.dumps(stamp(samples))),
        "stamp:collate-drawing": lambda: (draw(), pickle.dumps(default_collate(samples))),
    }
    gc.collect()
    gc.disable()  # a collection of the whole heap landing in one region would be its cost
    try:
        for name, work in regions.items():
            for _ in range(3):  # warm-up: the worker's first, whole stamp is not counted
                work()
            sys.getswitchinterval()
            for _ in range(STAMP_ROUNDS):
                work()
            sys.getallocatedblocks()
    finally:
        gc.enable()
    return list(regions)


def count_worker(names: Sequence[str], warmup: int, count: int, out: Path) -> None:
    """Run ``names`` in this process under callgrind; one JSON line per counted region."""
    import torch

    torch.set_num_threads(1)
    bench.preload([name for name in names if name.startswith(("lightning", "ignite"))])
    if "torchtnt" in names:
        import torchtnt.framework  # noqa: F401
    batches = bench.make_batches(bench.WORKLOADS["tiny"], warmup + count + 2 * bench.WINDOW)
    scratch = tempfile.mkdtemp(prefix="hookloop-instructions-")
    instrument_on()
    regions, finals = stamp_regions(), {}
    for name in names:
        torch.manual_seed(0)
        model = bench.make_model(bench.WORKLOADS["tiny"].sizes)
        optimizer = torch.optim.SGD(model.parameters(), lr=bench.LEARNING_RATE,
                                    momentum=bench.MOMENTUM)
        result = run_variant(name, model, optimizer, Marked(batches, warmup, count), scratch)
        regions.append(name)
        finals[name] = (result["steps"], [t.detach().clone() for t in model.state_dict().values()]
                        + [t.detach().clone() for t in result.get("ema", [])])
    same = {}
    for name, (steps, tensors) in finals.items():
        reference = finals.get(REFERENCE[name])
        expected = len(batches) // window_of(name)
        same[name] = (reference is not None and steps == expected
                      and len(tensors) == len(reference[1])
                      and all(torch.equal(a, b) for a, b in zip(tensors, reference[1])))
    shutil.rmtree(scratch, ignore_errors=True)
    (out / "regions.json").write_text(json.dumps({"regions": regions, "same": same}))


# --------------------------------------------------------------------------- parent side
def dumps(directory: Path) -> list[int]:
    """The instruction totals of the dumps the markers made, in order (the final dump at
    the process's end is left out)."""
    found = []
    for path in glob.glob(str(directory / "callgrind.out.*")):
        text = Path(path).read_text(errors="replace")
        part = re.search(r"^part: (\d+)$", text, re.MULTILINE)
        summary = re.search(r"^summary: (\d+)$", text, re.MULTILINE)
        reason = re.search(r"^desc: Trigger: (.*)$", text, re.MULTILINE)
        if part and summary and reason and DUMP in reason.group(1):
            found.append((int(part.group(1)), int(summary.group(1))))
    return [total for _, total in sorted(found)]


def python_binary() -> str:
    """This interpreter (``sys.executable`` is the binary, also under pyenv's shell-script
    shims; a virtual environment's link is kept, so its site-packages are seen)."""
    return sys.executable


def measure(names: Sequence[str], warmup: int, count: int,
            keep: str | None = None) -> dict[str, Any]:
    """Run the variants under callgrind; instructions per batch and the stamp figures.
    ``keep``: a folder to copy callgrind's files into (for ``callgrind_annotate``)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("the instruction mode needs valgrind (with callgrind_control)")
    with tempfile.TemporaryDirectory(prefix="hookloop-callgrind-") as directory:
        out = Path(directory)
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--dump-before={ZERO}", f"--dump-before={DUMP}",
                   f"--callgrind-out-file={out}/callgrind.out.%p", python_binary(),
                   str(Path(bench.__file__)), "--count-worker", json.dumps(list(names)),
                   "--warmup", str(warmup), "--count", str(count), "--out", str(out)]
        result = subprocess.run(command, env=bench.child_env(), capture_output=True, text=True,
                                timeout=7200)
        if result.returncode != 0 or not (out / "regions.json").exists():
            raise SystemExit(f"callgrind worker failed:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-4000:]}")
        told = json.loads((out / "regions.json").read_text())
        totals = dumps(out)
        if keep:
            shutil.copytree(out, keep, dirs_exist_ok=True)
    regions = told["regions"]
    if len(totals) != len(regions):
        raise SystemExit(f"expected {len(regions)} counted regions, callgrind dumped "
                         f"{len(totals)}: something else called {DUMP}")
    counted = dict(zip(regions, totals))
    rows = {name: counted[name] / count for name in names}
    batch = counted["stamp:batch"] / STAMP_ROUNDS
    stamp = (counted["stamp:stamp"] - counted["stamp:collate"]) / STAMP_ROUNDS
    drawing = (counted["stamp:stamp-drawing"] - counted["stamp:collate-drawing"]) / STAMP_ROUNDS
    return {"per_batch": rows, "same": told["same"], "batch": batch, "stamp": stamp,
            "stamp_drawing": drawing, "warmup": warmup, "count": count}


def available(names: Sequence[str]) -> list[str]:
    """``names`` less the peers that are not installed, or do not import (torchtnt 0.2 needs
    ``pkg_resources``, gone from setuptools 81)."""
    import importlib

    def imports(module: str) -> bool:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - any failure to import leaves the peer out
            return False
        return True

    return [name for name in names if name not in PEERS or imports(PEERS[name])]


def report(found: dict[str, Any]) -> list[str]:
    rows, same = found["per_batch"], found["same"]
    lines = [f"\n### instructions: MLP 32-64-10, batch 32, {found['count']} batches counted "
             f"after {found['warmup']} (callgrind)\n",
             "| variant | reference | instructions per batch | ratio | over reference | "
             "same weights |", "|---|---|---:|---:|---:|---|"]
    for name, value in rows.items():
        reference = REFERENCE[name]
        ratio = value / rows[reference]
        lines.append(f"| {name} | {reference} | {value:,.0f} | {ratio:.4f} | "
                     f"{value - rows[reference]:+,.0f} | {'yes' if same[name] else 'NO'} |")
    for count in (10, 50):
        name = f"hookloop+listen{count}"
        if name in rows:
            lines.append(f"\nper listening callback per batch ({count} callbacks): "
                         f"{(rows[name] - rows['hookloop']) / count:,.0f} instructions")
    if "hookloop+stack+views" in rows:
        lines.append(f"\nhookloop+stack+views over hand+stack (no views): "
                     f"{rows['hookloop+stack+views'] / rows['hand+stack']:.4f}x")
    lines.append(f"\nworker stamp: {found['stamp']:,.0f} instructions per batch, a cheap batch "
                 f"of 32 samples {found['batch']:,.0f}: {found['stamp'] / found['batch']:.3f}x "
                 f"(a dataset that draws from Python and NumPy at every batch: "
                 f"{found['stamp_drawing']:,.0f}, "
                 f"{found['stamp_drawing'] / found['batch']:.3f}x)")
    return lines


def main(names: Sequence[str] | None, warmup: int, count: int,
         json_path: str | None, keep: str | None = None) -> int:
    chosen = available(names or ORDER)
    for name in list(chosen):  # every variant needs its reference in the same run
        if REFERENCE[name] not in chosen:
            chosen.insert(0, REFERENCE[name])
    skipped = [name for name in (names or ORDER) if name not in chosen]
    print(f"hookloop instruction count: python {sys.version.split()[0]}, valgrind's callgrind, "
          f"{count} batches after {warmup} of warm-up, one process")
    if skipped:
        print(f"not run (not installed, or not importable): {', '.join(skipped)}")
    found = measure(chosen, warmup, count, keep)
    print("\n".join(report(found)))
    if json_path:
        Path(json_path).write_text(json.dumps(found, indent=1))
    if not all(found["same"].values()):
        print("FAILED: a variant did not end on its reference's weights (see 'same weights')")
        return 1
    return 0
