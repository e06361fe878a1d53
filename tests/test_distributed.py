"""Process-group helpers (hookloop/distributed.py) in one process: the fallbacks every
function has without a group, and the rank read from torchrun's environment. Their behaviour
over two real processes is in tests/distributed/."""

from __future__ import annotations

import pytest
import torch

from hookloop import distributed


def test_rank_falls_back_to_torchrun_environment_without_a_group(monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    assert not distributed.is_initialized()
    monkeypatch.setenv("RANK", "1")
    assert distributed.rank() == 1 and not distributed.is_main()
    assert distributed.world_size() == 1  # no collective can run without a group
    monkeypatch.setenv("RANK", "0")
    assert distributed.is_main()
    monkeypatch.delenv("RANK")
    assert distributed.rank() == 0 and distributed.is_main()


def test_distributed_helpers_fall_back_in_one_process() -> None:
    assert distributed.all_reduce_sums({"b": torch.tensor(2), "a": 1.5}) == {"a": 1.5, "b": 2.0}
    assert distributed.all_reduce_sums({}) == {}
    assert distributed.all_gather_object("x") == ["x"]
