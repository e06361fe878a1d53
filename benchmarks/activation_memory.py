"""What activation checkpointing saves: the bytes autograd keeps from a forward to its
backward, for a stack of transformer-style MLP blocks, without checkpointing, with full
checkpointing and with selective checkpointing (the matrix products saved), on the CPU.

    python benchmarks/activation_memory.py                     # width 256, 8 blocks, batch 64
    python benchmarks/activation_memory.py --width 32 --depth 2 --batch 8

Kept bytes are counted with ``torch.autograd.graph.saved_tensors_hooks`` (the distinct
storages of the tensors saved outside a checkpointed block, parameters apart:
``hookloop.callbacks.activation_checkpointing.saved_activation_bytes``) plus, for the
selective run, the outputs the policy saves inside the blocks (torch keeps them in the
policy's cache, which those hooks do not see: the policy below records each op it saves
and the bytes of its output). Each run's gradients are compared with the run without
checkpointing (dropout included): they must be equal bit for bit.

Exit status 1 when the gradients differ or checkpointing kept more; 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

from hookloop import Loop  # noqa: E402
from hookloop.callbacks import ActivationCheckpointing  # noqa: E402
from hookloop.callbacks.activation_checkpointing import saved_activation_bytes  # noqa: E402

SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(4 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(self.drop(F.gelu(self.up(self.norm(hidden)))))


class CountingPolicy:
    """Save the matrix products (as ``[aten.mm, aten.addmm]`` does) and count their bytes."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in SAVED_OPS:
            if not ctx.is_recompute:
                with torch.no_grad():
                    output = op(*args, **kwargs)  # the same shape the saved output has
                self.bytes += output.numel() * output.element_size()
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, 1))


def measure(kind: str, width: int, depth: int, batch: int) -> tuple[int, list[torch.Tensor]]:
    model = make_model(width, depth)
    policy = CountingPolicy() if kind == "selective" else None
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(batch, width, generator=generator)
    targets = torch.randn(batch, 1, generator=generator)
    if kind != "none":
        loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [(inputs, targets)],
                    loss_fn=F.mse_loss, device="cpu")
        ActivationCheckpointing(wrap={Block}, policy=policy).setup(loop)
    losses = []

    def forward() -> None:
        losses.append(F.mse_loss(model(inputs), targets))

    torch.manual_seed(2)
    kept = saved_activation_bytes(forward, model)
    losses[0].backward()
    if policy is not None:
        kept += policy.bytes
    return kept, [param.grad for param in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {kind: measure(kind, args.width, args.depth, args.batch)
               for kind in ("none", "full", "selective")}
    baseline, reference = results["none"]
    print(f"activation memory, {args.depth} blocks of width {args.width}, batch {args.batch}:")
    print("| checkpointing | kept bytes | share of none | gradients equal |")
    print("|---|---|---|---|")
    failed = False
    for kind, (kept, grads) in results.items():
        equal = all(torch.equal(first, second) for first, second in zip(reference, grads))
        failed |= not equal or kept > baseline
        print(f"| {kind} | {kept} | {kept / baseline:.3f} | {'yes' if equal else 'NO'} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
