"""A small transformer trained with FSDP + tensor parallel on a (dp=2, tp=2) device mesh.

    python examples/tensor_parallel.py                          # one process (nothing split)
    torchrun --nproc_per_node=4 examples/tensor_parallel.py     # dp=2 x tp=2
    torchrun --nproc_per_node=4 examples/tensor_parallel.py --tp 1   # FSDP over 4, no TP

Each block's attention splits its heads over the two ranks of a tensor-parallel group (the
query, key and value projections column-wise, the output projection row-wise), and its MLP
its hidden features (up column-wise, down row-wise): one all-reduce per attention and per
MLP in forward and in backward. FSDP then shards the split weights over the two
data-parallel ranks. The two ranks of a tensor-parallel group read the same batches;
activation checkpointing recomputes each block in backward.

The task needs no download: the next token of sequences counting up by a step of their
own, modulo the vocabulary (``3, 5, 7, 9, ...``); the model must read the step from the
context.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Loop, Mesh, distributed
from hookloop.callbacks import (
    FSDP,
    ActivationCheckpointing,
    GradAccumulation,
    GradClip,
    TensorParallel,
)

VOCABULARY, LENGTH = 32, 12


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_width = width // heads
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden.shape

        def heads(projection: nn.Module) -> torch.Tensor:
            # -1: under tensor parallel each rank holds a share of the heads
            return projection(hidden).view(batch, length, -1, self.head_width).transpose(1, 2)

        mixed = F.scaled_dot_product_attention(heads(self.query), heads(self.key),
                                               heads(self.value), is_causal=True)
        return self.out(mixed.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attention(self.attention_norm(hidden))
        return hidden + self.down(F.gelu(self.up(self.mlp_norm(hidden))))


class Transformer(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCABULARY, width)
        self.positions = nn.Parameter(torch.zeros(LENGTH, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(tokens) + self.positions[: tokens.shape[1]]
        for block in self.blocks:
            hidden = block(hidden)
        # The logits as (batch * length, vocabulary) rows: a linear layer on a 2-D input
        # returns a new tensor, on a 3-D one a view of its 2-D product, and FSDP warns when
        # the model returns a view (an in-place op on it would skip FSDP's backward hook).
        return self.head(self.norm(hidden).flatten(0, 1))


def plan() -> dict[str, object]:
    """Each block's attention and MLP split over the tensor-parallel ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.attention.query": ColwiseParallel(),
            "blocks.*.attention.key": ColwiseParallel(),
            "blocks.*.attention.value": ColwiseParallel(),
            "blocks.*.attention.out": RowwiseParallel(),
            "blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


def counting_sequences(count: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCABULARY, (count, 1), generator=generator)
    steps = torch.randint(1, 6, (count, 1), generator=generator)
    sequences = (starts + steps * torch.arange(LENGTH + 1)) % VOCABULARY
    return TensorDataset(sequences[:, :-1], sequences[:, 1:])


def next_token_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets.flatten())  # outputs: one row per token


class Report(Callback):
    rank_zero_only = True

    def on_fit_start(self, loop: Loop) -> None:
        kinds = sorted({type(param).__name__ for param in loop.unwrapped_model.parameters()})
        print(f"training on {distributed.world_size()} process(es), parameters {kinds}",
              flush=True)

    def on_epoch_end(self, loop: Loop) -> None:
        shown = "  ".join(f"{name} {value:.4f}" for name, value in loop.state.metrics.items()
                          if name in ("train_loss", "val_loss"))  # no val_loss after a stop
        print(f"epoch {loop.state.epoch + 1}/{loop.state.epochs}  step {loop.state.step}  "
              f"{shown}", flush=True)


def quiet_two_step_norm_notice() -> None:
    """Silence torch's notice that GradClip's gradient norm, partial over both mesh
    dimensions (dp_shard and tp), is summed by two all-reduces, one per dimension, which
    "may give inconsistent results between ranks due to different reduction orders".

    Harmless here: every rank runs the same two all-reduces in the same order, and an
    all-reduce hands all of its members the same sum, so every rank clips with the same
    norm (tests/distributed/test_mesh_processes.py compares this layout's losses with one
    process's). The cost, one more small all-reduce per optimizer step, is what a
    two-dimensional mesh costs. Only DTensor's redistribution notices are silenced; its
    errors still show.
    """
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--tp", type=int, default=2, help="ranks per tensor-parallel group")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16, help="per data-parallel rank")
    args = parser.parse_args(argv)
    quiet_two_step_norm_notice()

    torch.manual_seed(0)  # the same initial weights on every process
    model = Transformer()
    train = DataLoader(counting_sequences(args.samples, seed=1), batch_size=args.batch_size,
                       shuffle=True, generator=torch.Generator().manual_seed(2))
    val = DataLoader(counting_sequences(128, seed=3), batch_size=64)
    mesh = Mesh(dp_shard="auto", tp=args.tp)
    callbacks: list[Callback] = [
        ActivationCheckpointing(wrap={Block}),  # first: then split, then shard
        TensorParallel(plan(), mesh=mesh),
        FSDP(wrap={Block}, mesh=mesh),
        GradAccumulation(2), GradClip(1.0), Report()]
    loop = Loop(model, torch.optim.AdamW(model.parameters(), lr=3e-3), train, val_data=val,
                loss_fn=next_token_loss, callbacks=callbacks, device="cpu")
    return loop.fit(args.epochs, max_steps=args.max_steps).metrics


if __name__ == "__main__":
    main()
