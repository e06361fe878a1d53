"""Batch helpers (hookloop/engine/data.py): moving nested batches to a device, and the batch size of
a batch whose samples sit in nested containers."""

from __future__ import annotations

import collections

import pytest
import torch

from hookloop.engine.data import move_to_device


def test_nested_batches_are_moved_with_their_containers() -> None:
    Pair = collections.namedtuple("Pair", "a b")
    batch = {"x": [torch.ones(1), (torch.zeros(1), Pair(torch.ones(2), "tag"))], "n": 3}
    moved = move_to_device(batch, torch.device("meta"))
    assert moved["x"][0].device.type == "meta"
    assert isinstance(moved["x"][1], tuple) and isinstance(moved["x"][1][1], Pair)
    assert moved["x"][1][1].a.device.type == "meta" and moved["x"][1][1].b == "tag"
    assert moved["n"] == 3


@pytest.mark.parametrize("batch,targets,size", [
    ({"tokens": [[1, 2, 3, 4, 5, 6, 7], [1, 2], [3]], "labels": [0, 1, 1]}, [0, 1, 1], 3),
    ({"scale": torch.tensor(2.0), "x": torch.zeros(4, 3)}, None, 4),
    ({"meta": [torch.zeros(7)], "x": torch.zeros(5, 2)}, None, 5),
    ((torch.zeros(6, 2), torch.zeros(6)), torch.zeros(6), 6),
])
def test_batch_size_comes_from_the_samples_not_from_a_nested_sequence(batch, targets, size) -> None:
    from hookloop.engine.data import batch_size_of

    assert batch_size_of(batch, targets) == size
