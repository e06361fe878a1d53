"""The goodput ledger (`hookloop.parallel.ft_goodput`) against a hand-made clock: every
second charged once, the state carried across a peer transfer and a relaunch."""

from __future__ import annotations

from hookloop.parallel.ft_goodput import BUCKETS, Goodput


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_every_second_goes_to_one_bucket_and_saves_are_moved_out_of_training() -> None:
    clock = _Clock(1000.0)
    goodput = Goodput(clock=clock)
    goodput.begin()
    for bucket, seconds in [("quorum", 2.0), ("training", 5.0), ("redo", 0.5),
                            ("detection", 1.0), ("healing", 0.25)]:
        clock.now += seconds
        goodput.charge(bucket)
    clock.now += 3.0
    goodput.charge("training", minus=1.25)  # a save of 1.25 s inside those 3 s
    clock.now += 1.0
    goodput.charge("training", minus=9.0)  # never more than the elapsed time
    expected = {"quorum": 2.0, "training": 6.75, "redo": 0.5, "detection": 1.0,
                "healing": 0.25, "saving": 2.25, "takeover": 0.0, "restart": 0.0}
    assert goodput.seconds == {bucket: expected[bucket] for bucket in BUCKETS}
    assert goodput.wall == 12.75 == sum(goodput.seconds.values())


def test_the_time_since_a_snapshot_is_charged_to_the_gap_of_the_loader() -> None:
    clock = _Clock(50.0)
    peer = Goodput(clock=clock)
    peer.begin()
    clock.now += 10.0
    peer.charge("training")
    peer.count("dropped")
    snapshot = peer.state_dict()
    clock.now += 4.0  # the transfer (or, from a checkpoint, the lost work and the relaunch)
    healed = Goodput(clock=clock)
    healed.begin()  # its own launch's clock is replaced by the run's
    healed.load_state_dict(snapshot, gap="restart")
    assert healed.start == 50.0 and healed.wall == 14.0
    assert healed.seconds["training"] == 10.0 and healed.seconds["restart"] == 4.0
    assert healed.counts["dropped"] == 1
    clock.now += 1.0
    healed.charge("training")
    assert sum(healed.seconds.values()) == healed.wall == 15.0
    assert "restart" in healed.table() and "wall" in healed.table()
