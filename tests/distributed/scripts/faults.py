"""torchrun script: distributed faults that must fail clearly on every rank, never hang.

Usage: torchrun --nproc_per_node=2 faults.py OUT_DIR

1. after: a clean fit creates and destroys the process group; rank()/is_main() must still
   tell the ranks apart (torchrun's RANK).
2. unequal: ranks with 3 and 2 batches -> ConfigurationError on both, at setup.
3. unsized: data without a length -> ConfigurationError on both.
4. unpadded: UnpaddedDistributedSampler for training data -> ConfigurationError.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from common import make_model, make_optimizer, rank, regression_data, save
from hookloop import Callback, ConfigurationError, Loop, distributed
from hookloop.callbacks import DDP
from hookloop.callbacks.ddp import UnpaddedDistributedSampler


class Batches(Callback):
    def __init__(self) -> None:
        self.seen = 0

    def on_batch_start(self, loop: Loop) -> None:
        self.seen += 1


class Unsized:
    """Re-iterable batches without __len__ (a streaming source)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self) -> Any:
        generator = torch.Generator().manual_seed(rank())
        for _ in range(self.count):
            yield torch.randn(3, 4, generator=generator), torch.randn(3, 1, generator=generator)


def attempt(name: str, data: Any) -> None:
    model = make_model(seed=1)
    counter = Batches()
    loop = Loop(model, make_optimizer(model), data, loss_fn=nn.functional.mse_loss,
                callbacks=[DDP(), counter], device="cpu")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loop.fit(1)
        result = {"error": None, "batches": counter.seen}
    except ConfigurationError as error:
        result = {"error": str(error), "batches": counter.seen}
    save(name, result)


if __name__ == "__main__":
    model = make_model(seed=1)
    loop = Loop(model, make_optimizer(model), DataLoader(regression_data(12, seed=2), batch_size=3),
                loss_fn=nn.functional.mse_loss, callbacks=[DDP()], device="cpu")
    loop.fit(1)
    save("after", {"initialized": distributed.is_initialized(), "rank": distributed.rank(),
                        "is_main": distributed.is_main()})
    batches = [(torch.randn(3, 4), torch.randn(3, 1)) for _ in range(3 - rank())]
    attempt("unequal", batches)
    attempt("unsized", Unsized(3))
    dataset = regression_data(12, seed=2)
    attempt("unpadded", DataLoader(dataset, batch_size=3, sampler=UnpaddedDistributedSampler(
        dataset, num_replicas=2, rank=rank())))
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"rank {rank()} done", flush=True)
