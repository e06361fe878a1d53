"""FSDP against DDP on CUDA: the peak memory per GPU of one model trained each way, next
to what docs/distributed.md computes, and the two runs' weights compared.

    python benchmarks/fsdp_gpu_check.py                       # one GPU, nccl (a group of 1)
    torchrun --nproc_per_node=8 benchmarks/fsdp_gpu_check.py  # 8 GPUs: the shards are 1/8
    python benchmarks/fsdp_gpu_check.py --device cpu --width 64 --depth 2 --steps 2  # no GPU

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
from hookloop.callbacks import AMP, DDP, FSDP  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

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


def run(kind: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model = make_model(args.width, args.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1 + distributed.rank())
    batches = [(torch.randn(args.batch, args.width, generator=generator),
                torch.randn(args.batch, 1, generator=generator)) for _ in range(args.steps)]
    bf16 = device.type == "cuda"
    callbacks: list[Any] = ([DDP(), *([AMP(torch.bfloat16)] if bf16 else [])] if kind == "DDP"
                            else [FSDP(wrap={Block},
                                       mixed_precision=torch.bfloat16 if bf16 else None)])
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
    args = parser.parse_args()
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
    predicted = {"DDP": 16 * params, "FSDP": 16 * params / world + 2 * block * 2 + 4 * block}
    results = {kind: run(kind, args, device) for kind in ("DDP", "FSDP")}
    difference = max((results["DDP"]["weights"][name] - value).abs().max().item()
                     for name, value in results["FSDP"]["weights"].items())
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
        failed |= results["FSDP"]["peak"] >= results["DDP"]["peak"]
    print(f"rank {distributed.rank()} largest weight difference FSDP - DDP: {difference:.2e}",
          flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
