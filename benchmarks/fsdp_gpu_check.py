"""FSDP against DDP on CUDA: the peak memory per GPU of one model trained each way, next
to what docs/distributed.md computes, and the two runs' weights compared; with
``--layouts all`` also HSDP, tensor parallel (FSDP + TP) and FSDP with activation
checkpointing.

    python benchmarks/fsdp_gpu_check.py                       # one GPU, nccl (a group of 1)
    torchrun --nproc_per_node=8 benchmarks/fsdp_gpu_check.py  # 8 GPUs: the shards are 1/8
    torchrun --nproc_per_node=8 benchmarks/fsdp_gpu_check.py --layouts all
    python benchmarks/fsdp_gpu_check.py --device cpu --width 64 --depth 2 --steps 2  # no GPU

Layouts: ``DDP``; ``FSDP`` (``wrap={Block}``); ``HSDP`` (``Mesh(dp_replicate="auto",
dp_shard=2)``: 2 shards per replica); ``TP`` (``Mesh(dp_shard="auto", tp=2)``:
``TensorParallel`` on each block's two Linear layers, then FSDP over the data-parallel
ranks; on an odd number of ranks tp=1); ``FSDP+AC`` (``ActivationCheckpointing(wrap={Block})``
before FSDP). Under TP the two ranks of a group train on the same batches, so its weights
are not compared with DDP's (n/a); the other layouts train on the same batches as DDP.

The model is ``depth`` residual MLP blocks of width ``width`` (about ``8 width^2``
parameters each), trained ``steps`` AdamW steps in bfloat16 (AMP under DDP, FSDP's mixed
precision under FSDP) on the same random batches, first with ``DDP()``, then with
``FSDP(wrap={Block})``. Per rank it prints ``torch.cuda.max_memory_allocated`` of each
run (reset before it), the memory still held after it (weights, gradients, optimizer
state), the prediction (``16 P`` for DDP; ``16 P / N`` plus two gathered blocks for FSDP),
and the largest difference between the two runs' final weights (bf16 rounding: small,
not zero). On a CPU (``--device cpu``, gloo) the memory columns say n/a.

Exit status 1 when a run's loss is not finite or FSDP used more memory than DDP on more
than one GPU; 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from hookloop import Loop, distributed  # noqa: E402
from hookloop.callbacks import AMP, DDP, FSDP, ActivationCheckpointing, TensorParallel  # noqa: E402
from hookloop.parallel.mesh import Mesh  # noqa: E402

LAYOUTS = ("DDP", "FSDP", "HSDP", "TP", "FSDP+AC")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.norm(hidden))


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, 1))


def start_group(device: torch.device) -> None:
    """The process group: torchrun's, or a group of one process on a free port."""
    if "RANK" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def layout(kind: str, bf16: bool, world: int) -> tuple[list[Any], int]:
    """The callbacks of a layout, and the index of the data this rank trains on."""
    precision = torch.bfloat16 if bf16 else None
    if kind == "DDP":
        return [DDP(), *([AMP(torch.bfloat16)] if bf16 else [])], distributed.rank()
    if kind == "FSDP":
        return [FSDP(wrap={Block}, mixed_precision=precision)], distributed.rank()
    if kind == "HSDP":
        shards = 2 if world % 2 == 0 else 1
        mesh = Mesh(dp_replicate="auto", dp_shard=shards)
        return [FSDP(wrap={Block}, mixed_precision=precision, mesh=mesh)], distributed.rank()
    if kind == "TP":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        mesh = Mesh(dp_shard="auto", tp=2 if world % 2 == 0 else 1)
        plan = {"*.mlp.0": ColwiseParallel(), "*.mlp.2": RowwiseParallel()}
        return ([TensorParallel(plan, mesh=mesh),
                 FSDP(wrap={Block}, mixed_precision=precision, mesh=mesh)],
                mesh.data_parallel()[1])
    if kind == "FSDP+AC":
        return ([ActivationCheckpointing(wrap={Block}),
                 FSDP(wrap={Block}, mixed_precision=precision)], distributed.rank())
    raise SystemExit(f"unknown layout {kind!r}; choose from {', '.join(LAYOUTS)} or all")


def run(kind: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model = make_model(args.width, args.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    bf16 = device.type == "cuda"
    callbacks, data_index = layout(kind, bf16, distributed.world_size())
    generator = torch.Generator().manual_seed(1 + data_index)
    batches = [(torch.randn(args.batch, args.width, generator=generator),
                torch.randn(args.batch, 1, generator=generator)) for _ in range(args.steps)]
    loop = Loop(model, optimizer, batches, loss_fn=nn.functional.mse_loss, device=device,
                callbacks=callbacks, sanity_val_batches=0)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    state = loop.fit(1)
    result: dict[str, Any] = {"loss": float(state.metrics["train_loss"])}
    if device.type == "cuda":
        torch.cuda.synchronize()
        result["peak"] = torch.cuda.max_memory_allocated()
        result["held"] = torch.cuda.memory_allocated()
    weights = loop.unwrapped_model.state_dict()
    result["weights"] = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value)
                         .detach().float().cpu() for name, value in weights.items()}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="per rank")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    parser.add_argument("--layouts", default="DDP,FSDP",
                        help=f"comma-separated, of {', '.join(LAYOUTS)}; or all")
    args = parser.parse_args()
    kinds = list(LAYOUTS) if args.layouts == "all" else args.layouts.split(",")
    if "DDP" not in kinds:
        kinds.insert(0, "DDP")  # the reference of the weights and the memory
    # Each rank trains on its own list of random batches (nothing for DDP/FSDP to shard).
    warnings.filterwarnings("ignore", message=".*not a DataLoader")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; pass --device cpu to try the script on the CPU")
        return 0
    start_group(device)
    world = distributed.world_size()
    params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    block = sum(p.numel() for p in Block(args.width).parameters())
    sharded = 16 * params / world + 2 * block * 2 + 4 * block
    predicted = {"DDP": 16 * params, "FSDP": sharded, "FSDP+AC": sharded,
                 "HSDP": 16 * params / (2 if world % 2 == 0 else 1) + 2 * block * 2 + 4 * block,
                 "TP": sharded}
    results = {kind: run(kind, args, device) for kind in kinds}
    differences = {kind: max((results["DDP"]["weights"][name] - value).abs().max().item()
                             for name, value in result["weights"].items())
                   for kind, result in results.items() if kind not in ("DDP", "TP")}
    failed = False
    gib = 2 ** 30
    if distributed.is_main():
        print(f"{params / 1e6:.1f}M parameters ({args.depth} blocks of {block / 1e6:.1f}M), "
              f"{world} rank(s), {device.type}, batch {args.batch} per rank, {args.steps} steps")
    for kind, result in results.items():
        memory = (f"peak {result['peak'] / gib:6.2f} GiB  held {result['held'] / gib:6.2f} GiB"
                  if "peak" in result else "peak n/a  held n/a")
        print(f"rank {distributed.rank()} {kind:4s}  {memory}  predicted state "
              f"{predicted[kind] / gib:6.2f} GiB  train_loss {result['loss']:.4f}", flush=True)
        failed |= not torch.isfinite(torch.tensor(result["loss"])).item()
    if "peak" in results["DDP"] and world > 1:
        failed |= any(results[kind]["peak"] >= results["DDP"]["peak"]
                      for kind in results if kind != "DDP")
    for kind, difference in differences.items():
        print(f"rank {distributed.rank()} largest weight difference {kind} - DDP: "
              f"{difference:.2e}", flush=True)
    if "TP" in results:
        print(f"rank {distributed.rank()} largest weight difference TP - DDP: n/a "
              "(a tensor-parallel group trains on one batch)", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
