"""A short check of hookloop on a CUDA GPU, printing one table.

1. ``no host sync``: the standard stack (bf16 autocast, accumulation 2, clipping, EMA, a
   warmup-cosine schedule) and MemoryMonitor train under
   ``torch.cuda.set_sync_debug_mode("error")`` from the first batch's start to the last
   batch's end, batches coming from pinned memory: any host sync in there raises.
2. ``fp16 parity``: AMP(float16) with its GradScaler and GradClip against a hand-written
   autocast/GradScaler loop on the same GPU: the same weights and the same scale.
3. ``compile``: Compile() (inductor) on the small MLP with the stack: the number of
   compiled graphs after the first epoch does not change in the next two (dynamo's
   counters); Compile(optimizer=True) too.
4. ``small ratio`` (reported): the small workload (MLP 512-1024-1024-10, batch 128, 300
   steps) by hand and by hookloop, bare and with the stack, interleaved over 5 rounds: the
   median ratio of times to the hand-written loop (synchronized at the end of each run).
5. ``throughput`` (reported): what ThroughputMonitor and MemoryMonitor say of the stack
   run, MFU against 989 TFLOP/s (the dense bf16 peak of an H100/H200 SXM).

Exits 1 when a check fails, 0 otherwise; on a machine without CUDA it says so and exits
0. ``--device cpu`` runs the same code on the CPU (the sync check is skipped there), to
try the script without a GPU.

Usage:
    python benchmarks/gpu_check.py [--rounds 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SIZES = (512, 1024, 1024, 10)
BATCH = 128
BATCHES = 300


def make_model(device: torch.device) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for index, (width_in, width_out) in enumerate(zip(SIZES, SIZES[1:])):
        if index:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(width_in, width_out))
    return torch.nn.Sequential(*layers).to(device)


def make_batches(count: int, *, pinned: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(count, BATCH, SIZES[0], generator=generator)
    targets = torch.randint(0, SIZES[-1], (count, BATCH), generator=generator)
    if pinned:
        inputs, targets = inputs.pin_memory(), targets.pin_memory()
    return [(inputs[index], targets[index]) for index in range(count)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stack() -> list[Any]:
    from hookloop.callbacks import AMP, EMA, GradAccumulation, GradClip, LRScheduler
    from hookloop.schedules import warmup_cosine

    return [AMP(torch.bfloat16), GradAccumulation(2), GradClip(1.0), EMA(0.999),
            LRScheduler(functools.partial(warmup_cosine, warmup_steps=0.05))]


def hookloop_loop(device: torch.device, batches: list[Any], callbacks: list[Any],
                  val: list[Any] | None = None) -> Any:
    from hookloop import Loop

    torch.manual_seed(0)
    model = make_model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return Loop(model, optimizer, batches, val_data=val, loss_fn=F.cross_entropy,
                callbacks=callbacks, device=device, sanity_val_batches=2 if val else 0)


# ----------------------------------------------------------------------------- checks
def check_no_sync(device: torch.device) -> tuple[bool, str]:
    from hookloop import Callback

    if device.type != "cuda":
        return True, "skipped: set_sync_debug_mode is CUDA's"

    class SyncDebug(Callback):
        """'error' from the first batch's start to the last batch's end."""

        def __init__(self) -> None:
            self.batches = 0

        def on_batch_start(self, loop: Any) -> None:
            torch.cuda.set_sync_debug_mode("error")

        def on_batch_end(self, loop: Any) -> None:
            self.batches += 1
            if loop.state.batch_idx == loop.batches_per_epoch - 1:
                torch.cuda.set_sync_debug_mode("default")

    from hookloop.callbacks import MemoryMonitor

    probe = SyncDebug()
    loop = hookloop_loop(device, make_batches(64, pinned=True),
                         [probe, *stack(), MemoryMonitor()])
    try:
        loop.fit(2)
    except RuntimeError as error:
        return False, f"a host sync: {str(error).splitlines()[0][:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return True, f"{probe.batches} batches, 2 epochs, none"


def hand_fp16(device: torch.device, batches: list[Any]) -> tuple[torch.nn.Module, float]:
    torch.manual_seed(0)
    model = make_model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    model.train()
    for inputs, targets in batches:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return model, scaler.get_scale()


def check_fp16_parity(device: torch.device) -> tuple[bool, str]:
    from hookloop.callbacks import AMP, GradClip

    batches = make_batches(40, pinned=device.type == "cuda")
    hand, hand_scale = hand_fp16(device, batches)
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    loop = hookloop_loop(device, batches, [amp, GradClip(1.0)])
    loop.fit(1)
    largest = max(float((a - b).abs().max())
                  for a, b in zip(hand.state_dict().values(), loop.model.state_dict().values()))
    scale = amp.scaler.get_scale() if amp.scaler is not None else float("nan")
    same = largest <= 1e-6 and scale == hand_scale
    return same, f"largest weight difference {largest:.1e}, scale {scale:g} (hand {hand_scale:g})"


def check_compile(device: torch.device, backend: str) -> tuple[bool, str]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from hookloop import Callback
    from hookloop.callbacks import Compile

    class Graphs(Callback):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_epoch_end(self, loop: Any) -> None:
            self.seen.append(counters["stats"]["unique_graphs"])

    details, passed = [], True
    for optimizer in (False, True):
        torch._dynamo.reset()
        counters.clear()
        graphs = Graphs()
        batches = make_batches(41, pinned=device.type == "cuda")  # a smaller last window
        train = batches[:-1] + [(batches[-1][0][:32], batches[-1][1][:32])]
        loop = hookloop_loop(device, train, [*stack(), Compile(optimizer=optimizer,
                                                               backend=backend), graphs],
                             val=batches[:5])
        start = time.perf_counter()
        loop.fit(3)
        steady = graphs.seen == [graphs.seen[0]] * 3
        passed = passed and steady
        details.append(f"{'model+step' if optimizer else 'model'}: graphs per epoch "
                       f"{graphs.seen} ({time.perf_counter() - start:.0f} s)")
    return passed, "; ".join(details)


def hand_run(device: torch.device, batches: list[Any], *, with_stack: bool) -> None:
    from hookloop.schedules import warmup_cosine

    torch.manual_seed(0)
    model = make_model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    window = 2 if with_stack else 1
    if with_stack:
        scheduler = warmup_cosine(optimizer, len(batches) // window, warmup_steps=0.05)
        sources = [tensor.detach() for tensor in model.state_dict(keep_vars=True).values()]
        shadow = [tensor.detach().clone().float() for tensor in sources]
    updates = 0
    losses = []
    model.train()
    for index, (inputs, targets) in enumerate(batches):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if with_stack
                    else contextlib.nullcontext())
        with autocast:
            loss = F.cross_entropy(model(inputs), targets)
        losses.append(loss.detach())
        (loss / window if with_stack else loss).backward()
        if (index + 1) % window:
            continue
        if with_stack:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        if with_stack:
            torch._foreach_lerp_(shadow, sources, 1.0 - min(0.999, (1.0 + updates) / (10.0 + updates)))
            updates += 1
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    torch.stack(losses).double().mean().item()


def check_small_ratio(device: torch.device, rounds: int) -> tuple[bool | None, str]:
    batches = make_batches(BATCHES, pinned=device.type == "cuda")
    runs: dict[str, Callable[[], Any]] = {
        "hand": lambda: hand_run(device, batches, with_stack=False),
        "hookloop": lambda: hookloop_loop(device, batches, []).fit(1),
        "hand+stack": lambda: hand_run(device, batches, with_stack=True),
        "hookloop+stack": lambda: hookloop_loop(device, batches, stack()).fit(1),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for index in range(rounds + 1):
        for name in names[index % len(names):] + names[:index % len(names)]:
            synchronize(device)
            start = time.perf_counter()
            runs[name]()
            synchronize(device)
            if index:  # round 0 warms up kernels, allocator and caches
                times[name].append(time.perf_counter() - start)

    def ratio(name: str, reference: str) -> float:
        return statistics.median(t / r for t, r in zip(times[name], times[reference]))

    bare, stacked = ratio("hookloop", "hand"), ratio("hookloop+stack", "hand+stack")
    per_step = statistics.median(times["hand"]) / BATCHES * 1e6
    # Reported, not judged: the 1% target is the CPU reference machine's. On a GPU this
    # model's step is a few microseconds of compute and the rest is kernel launches, so
    # the loop's own microseconds show here as they do in the tiny CPU workload.
    return None, (f"hookloop/hand {bare:.3f}, stack/hand stack {stacked:.3f} (hand: "
                  f"{per_step:.0f} us/step, median of {rounds} rounds)")


def throughput(device: torch.device) -> tuple[bool | None, str]:
    from hookloop.callbacks import MemoryMonitor, ThroughputMonitor

    # On CUDA the peak comes from the device's name (PEAK_FLOPS); elsewhere there is none.
    monitor = ThroughputMonitor(every_n_steps=50,
                                flops_per_sample="measure" if device.type == "cuda" else None)
    loop = hookloop_loop(device, make_batches(BATCHES, pinned=device.type == "cuda"),
                         [*stack(), monitor, MemoryMonitor()])
    metrics = loop.fit(1).metrics
    mfu = metrics.get("mfu")
    return None, (f"{metrics['samples_per_s']:.0f} samples/s, {metrics['batches_per_s']:.0f} "
                  f"batches/s, {(monitor.flops_per_sample or 0) / 1e6:.1f} MFLOP/sample"
                  + (f", MFU {mfu:.2%} of the device's peak (PEAK_FLOPS)" if mfu is not None
                     else "")
                  + f", peak memory {metrics['peak_memory_mib']:.0f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing "
              "to check. Run it on a GPU machine, or with --device cpu to try the script.")
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"hookloop GPU check on {name}, torch {torch.__version__}\n")
    checks = [("no host sync", lambda: check_no_sync(device)),
              ("fp16 parity", lambda: check_fp16_parity(device)),
              ("compile", lambda: check_compile(device, args.backend)),
              ("small ratio", lambda: check_small_ratio(device, args.rounds)),
              ("throughput", lambda: throughput(device))]
    print("| check | result | detail |")
    print("|---|---|---|")
    failed = False
    for label, check in checks:
        passed: bool | None
        try:
            passed, detail = check()
        except Exception as error:  # one failing check must not hide the others
            passed, detail = False, f"raised {type(error).__name__}: {str(error)[:200]}"
        failed = failed or passed is False
        result = "info" if passed is None else ("pass" if passed else "FAIL")
        print(f"| {label} | {result} | {detail} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
