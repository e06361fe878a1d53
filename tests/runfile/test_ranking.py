"""TopK, the pure top-k ranking behind Checkpoint(save_top_k): against rankings by hand."""

from __future__ import annotations

import pytest

from hookloop.runfile.ranking import TopK


def higher(value: float, other: float) -> bool:
    return value > other


def lower(value: float, other: float) -> bool:
    return value < other


def offered(ranking: TopK, values: list[float]) -> list[list[tuple[float, int]]]:
    """Offer values at steps 1, 2, ...; what dropped out after each, as (value, step)."""
    return [[(entry["value"], entry["step"]) for entry in
             ranking.offer(value, epoch=step - 1, step=step, file=f"f{step}.pt")]
            for step, value in enumerate(values, start=1)]


def kept(ranking: TopK) -> list[tuple[float, int]]:
    return [(entry["value"], entry["step"]) for entry in ranking.entries]


def test_k_2_by_hand() -> None:
    ranking = TopK(higher, 2)
    # 0.5 -> [0.5]; 0.7 -> [0.7, 0.5]; 0.6 beats 0.5 -> [0.7, 0.6], 0.5 out;
    # 0.7 ties the best and beats 0.6 -> [0.7 (2), 0.7 (4)], 0.6 out;
    # 0.9 -> [0.9, 0.7 (2)], the later 0.7 out; 0.7 again ties the 2nd: it does not enter.
    dropped = offered(ranking, [0.5, 0.7, 0.6, 0.7, 0.9, 0.7])
    assert dropped == [[], [], [(0.5, 1)], [(0.6, 3)], [(0.7, 4)], [(0.7, 6)]]
    assert kept(ranking) == [(0.9, 5), (0.7, 2)]
    assert ranking.best == {"value": 0.9, "epoch": 4, "step": 5, "file": "f5.pt"}
    assert ranking.files() == {"f5.pt", "f2.pt"}


def test_admits_says_what_offer_would_do() -> None:
    ranking = TopK(lower, 2)
    assert ranking.admits(3.0, step=1)  # room left
    offered(ranking, [3.0, 1.0])
    assert not ranking.admits(3.0, step=3)  # a tie with the 2nd best stays out
    assert not ranking.admits(4.0, step=3)
    assert ranking.admits(2.5, step=3)


@pytest.mark.parametrize(("better", "expected"), [
    (higher, [(0.9, 5), (0.9, 7), (0.7, 2), (0.7, 4), (0.6, 3), (0.5, 1), (0.1, 6)]),
    (lower, [(0.1, 6), (0.5, 1), (0.6, 3), (0.7, 2), (0.7, 4), (0.9, 5), (0.9, 7)]),
])
def test_k_none_keeps_everything_in_order(better, expected) -> None:
    ranking = TopK(better, None)
    assert offered(ranking, [0.5, 0.7, 0.6, 0.7, 0.9, 0.1, 0.9]) == [[]] * 7
    assert kept(ranking) == expected


def test_top_1_in_min_mode() -> None:
    ranking = TopK(lower, 1)
    dropped = offered(ranking, [0.8, 0.9, 0.4, 0.4, 0.2])
    assert dropped == [[], [(0.9, 2)], [(0.8, 1)], [(0.4, 4)], [(0.4, 3)]]
    assert kept(ranking) == [(0.2, 5)]


def test_merge_ranks_found_entries_in_step_order() -> None:
    """A state saved at step 4 knew [0.7 (2), 0.5 (4)]; files of steps 6 and 8 were written
    before a kill. Offered in step order: 0.6 (6) drops 0.5; 0.7 (8) ties 0.7 (2), beats
    0.6 and drops it. Given in any order, the result is the same."""
    ranking = TopK(higher, 2)
    ranking.load_state_dict([{"value": 0.7, "epoch": 0, "step": 2, "file": "a.pt"},
                             {"value": 0.5, "epoch": 1, "step": 4, "file": "b.pt"}])
    found = [{"value": 0.7, "epoch": -1, "step": 8, "file": "d.pt"},
             {"value": 0.6, "epoch": -1, "step": 6, "file": "c.pt"}]
    dropped = ranking.merge(found)
    assert [(at, entry["file"]) for at, entry in dropped] == [(6, "b.pt"), (8, "c.pt")]
    assert kept(ranking) == [(0.7, 2), (0.7, 8)]


def test_state_dict_round_trip_is_plain() -> None:
    ranking = TopK(higher, 3)
    offered(ranking, [0.2, 0.4])
    state = ranking.state_dict()
    assert state == [{"value": 0.4, "epoch": 1, "step": 2, "file": "f2.pt"},
                     {"value": 0.2, "epoch": 0, "step": 1, "file": "f1.pt"}]
    state[0]["value"] = 99.0  # a copy: the ranking is unchanged
    again = TopK(higher, 3)
    again.load_state_dict(ranking.state_dict())
    assert kept(again) == kept(ranking) == [(0.4, 2), (0.2, 1)]


def test_the_same_step_is_one_validation() -> None:
    """A run resumed before step 16 replays its validation; the ranking (merged from the
    files after a kill) holds it already: equal or worse, it is not counted again; better,
    it replaces the entry of that step instead of pushing another one out."""
    ranking = TopK(lower, 2)
    ranking.load_state_dict([{"value": 0.45, "epoch": 3, "step": 16, "file": "a.pt"},
                             {"value": 0.5, "epoch": 1, "step": 8, "file": "b.pt"}])
    assert not ranking.admits(0.45, step=16) and not ranking.admits(0.47, step=16)
    assert [entry["step"] for entry in ranking.offer(0.45, 3, 16, "a.pt")] == [16]  # itself
    assert kept(ranking) == [(0.45, 16), (0.5, 8)]
    assert ranking.admits(0.4, step=16)
    dropped = ranking.offer(0.4, 3, 16, "c.pt")
    assert [(entry["value"], entry["file"]) for entry in dropped] == [(0.45, "a.pt")]
    assert kept(ranking) == [(0.4, 16), (0.5, 8)]
    # Only the entry of that step is replaced: 0.6 at step 8 is worse than 0.5 there.
    assert not ranking.admits(0.6, step=8)
    assert ranking.offer(0.55, 5, 24, "d.pt") == [{"value": 0.55, "epoch": 5, "step": 24,
                                                     "file": "d.pt"}]
