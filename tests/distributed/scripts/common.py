"""Data, models and helpers shared by the torchrun scripts and by the oracles of
tests/distributed/test_ddp_two_processes.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FEATURES = 4


def regression_data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    targets = inputs @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(
        samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


def classification_data(samples: int, seed: int, classes: int = 3) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    return TensorDataset(inputs, labels)


def make_model(seed: int, outputs: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, outputs))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def shuffled_loader(dataset: TensorDataset, batch_size: int, seed: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def out_dir() -> Path:
    path = Path(sys.argv[1])
    path.mkdir(parents=True, exist_ok=True)
    return path


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def save(name: str, value: Any) -> None:
    """Write ``value`` under ``<out>/<name>.rank<r>.pt`` (tensors) or ``.json``."""
    directory = out_dir()
    if isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
        torch.save(value, directory / f"{name}.rank{rank()}.pt")
    else:
        (directory / f"{name}.rank{rank()}.json").write_text(json.dumps(value))
