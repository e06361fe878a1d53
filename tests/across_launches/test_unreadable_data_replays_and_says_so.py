"""Data that cannot be advanced without reading it (a list, an iterable without a state)
resumes inside an epoch by fetching the trained batches again, as before, and the resume
says so in one line naming how many; a DataLoader over a map-style dataset says nothing,
since it reads none of them."""
from __future__ import annotations

import pytest
from torch.utils.data import DataLoader, TensorDataset

from hookloop.callbacks import Checkpoint

from builders import StopAt, net_batches, net_loop, same_weights


class Batches:
    """An iterable of batches without a state (and without a sampler)."""

    def __init__(self) -> None:
        self.batches = net_batches(6)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return 6


def _loader():
    inputs = [x for x, _ in net_batches(6)]
    targets = [y for _, y in net_batches(6)]
    import torch
    return DataLoader(TensorDataset(torch.cat(inputs), torch.cat(targets)), batch_size=4)


@pytest.mark.parametrize("kind", ["iterable", "list", "loader"])
def test_a_resume_says_how_many_batches_it_fetches_again(tmp_path, capsys, kind) -> None:
    data = {"iterable": Batches, "list": lambda: net_batches(6), "loader": _loader}[kind]
    expected = net_loop(train=data(), sanity_val_batches=0)
    expected.fit(2)
    first = net_loop([Checkpoint(tmp_path), StopAt(10, resumable=True)], train=data(),
                     sanity_val_batches=0)
    with pytest.raises(SystemExit):  # the launch ends at step 10, after 4 of 6 batches
        first.fit(2)
    capsys.readouterr()
    resumed = net_loop([Checkpoint(tmp_path, resume=True)], train=data(), sanity_val_batches=0)
    resumed.fit(2)
    assert same_weights(resumed, expected)
    lines = [line for line in capsys.readouterr().out.splitlines() if "again" in line]
    if kind == "loader":
        assert lines == []
    else:
        assert len(lines) == 1
        assert "fetches the 4 batches already trained on again" in lines[0]
        assert "state_dict()" in lines[0] and "DataLoader" in lines[0]
