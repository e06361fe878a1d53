"""FaultTolerance with real processes: a torchft lighthouse on a free port, two replica groups
as processes, SIGKILLs at random moments, and plain 2-rank DDP (torchrun) as the oracle.

One launch per scenario, every process with a timeout: a hang is a failure.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT, subprocess_env

pytest.importorskip("torchft")

SCRIPT = ROOT / "tests" / "parallel" / "ft_train.py"
#: Runs each torchrun worker without the interpreter's finalization (why: its docstring).
UNFINALIZED = ROOT / "tests" / "distributed" / "scripts" / "without_finalizing.py"
TIMEOUT = 480  # seconds for a whole scenario


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return int(probe.getsockname()[1])


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun's workers run in sessions of their own, so a
    process group's signal would miss them)."""
    found = [pid]
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                found += _tree(int(child))
    return found


class _Run:
    """A lighthouse and the replica groups of one scenario, all killed at the end. A group
    is one process, or (``ranks=2``: HSDP) torchrun with two, FSDP inside the group."""

    def __init__(self, out: Path, *, epochs: int, step_sleep: float, groups: int = 2,
                 checkpoint: bool = False, ranks: int = 1, extra: tuple[str, ...] = ()) -> None:
        self.out, self.groups, self.processes, self.ranks = out, groups, {}, ranks
        self.args = ["ft" if ranks == 1 else "hsdp", str(out), "--step-sleep",
                     str(step_sleep), *extra]
        if checkpoint:
            self.args.append("--checkpoint")
        port = _free_port()
        self.lighthouse = subprocess.Popen(
            ["torchft_lighthouse", "--min_replicas", "1", "--bind", f"[::]:{port}",
             "--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "1000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.env = subprocess_env()
        self.env.update({"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}",
                         "HOOKLOOP_FT_GROUPS": str(groups), "FT_TEST_EPOCHS": str(epochs),
                         "HOOKLOOP_FT_RUN_DIR": str(out / "run")})
        self.starts = {group: 0 for group in range(groups)}

    def start(self, group: int) -> None:
        self.starts[group] += 1
        log = open(self.out / f"group{group}_{self.starts[group]}.log", "w")
        env = dict(self.env, HOOKLOOP_FT_GROUP=str(group))
        launch = [] if self.ranks == 1 else [  # the wrapper: tests/distributed/scripts/
            "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.ranks}",
            str(UNFINALIZED)]
        self.processes[group] = subprocess.Popen(
            [sys.executable, *launch, str(SCRIPT), *self.args], cwd=ROOT, env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)

    def signal(self, group: int, number: int) -> None:
        """Send ``number`` to every process of ``group`` (torchrun and its workers)."""
        for pid in _tree(self.processes[group].pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)

    def log(self, group: int) -> str:
        return (self.out / f"group{group}_{self.starts[group]}.log").read_text()

    def commits(self, group: int) -> int:
        return self.log(group).count("should_commit completed should_commit=true")

    def wait_all(self, deadline: float) -> dict[int, int]:
        codes = {}
        for group, process in self.processes.items():
            codes[group] = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        return codes

    def close(self) -> None:
        for group, process in self.processes.items():
            self.signal(group, signal.SIGKILL)
            process.wait()
        os.killpg(self.lighthouse.pid, signal.SIGKILL)
        self.lighthouse.wait()


def _ddp_oracle(out: Path, epochs: int, ranks: int = 2,
                extra: tuple[str, ...] = ()) -> dict[str, Any]:
    env = subprocess_env()
    env["FT_TEST_EPOCHS"] = str(epochs)
    env.pop("RANK", None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
         str(UNFINALIZED), str(SCRIPT), "ddp", str(out), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return torch.load(out / "result_0.pt")


def _check_every_sample_once(ledger: list[list[int]], epochs: int, ranks: int = 1,
                             window: int = 1) -> None:
    from ft_train import BATCH, SAMPLES

    from hookloop.parallel.ft_plan import shard_indices

    steps = [entry[0] for entry in ledger]
    assert steps == list(range(len(ledger))), "each committed step once, in order"
    trained: dict[int, list[int]] = {epoch: [] for epoch in range(epochs)}
    for _, epoch, last, *plan in ledger:
        for batch, shard in itertools.product(  # a step: its accumulation window's batches
                range(last - last % window, last + 1), range(len(plan) * ranks)):
            # a group's shard: one per rank of it; the loader's seed: its generator's
            # (ft_train.py seeds it with 7)
            trained[epoch] += shard_indices(SAMPLES, len(plan) * ranks, shard, epoch=epoch,
                                            batch=batch, batch_size=BATCH, shuffle=True,
                                            seed=7)
    for epoch, samples in trained.items():
        assert sorted(samples) == list(range(SAMPLES)), f"epoch {epoch}: {sorted(samples)}"


def _check_logs_once_each(out: Path, oracle: dict[str, Any], epochs: int) -> None:
    """The CSV file (read by the csv module) and the TensorBoard directory (read by
    TensorBoard's own EventAccumulator) hold every step's row once, with plain DDP's
    values: the loss of the global batch (to summation order) and the learning rate."""
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = oracle["steps"]
    with open(out / "log.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    steps = [row for row in rows if row["kind"] == "step"]
    assert [int(row["step"]) for row in steps] == sorted(expected), "each step's row once"
    for row in steps:
        loss, lr = expected[int(row["step"])]
        assert abs(float(row["loss"]) - loss) <= 1e-4, (row, loss)
        assert float(row["lr"]) == lr, (row, lr)
    history = [int(row["epoch"]) for row in rows if row["kind"] == "history"]
    assert history == list(range(epochs)), history
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    for tag in events.Tags()["scalars"]:
        tag_steps = [event.step for event in events.Scalars(tag)]
        assert len(tag_steps) == len(set(tag_steps)), (tag, tag_steps)
    for tag, column in (("step/loss", 0), ("step/lr", 1)):
        scalars = events.Scalars(tag)
        assert sorted(event.step for event in scalars) == sorted(expected), tag
        for event in scalars:
            assert abs(event.value - expected[event.step][column]) <= 1e-4, (tag, event)


def _without_faults(out: Path, *, epochs: int, step_sleep: float, ranks: int = 1
                    ) -> list[dict[str, Any]]:
    """Both groups run to the end with no fault; each group's result."""
    out.mkdir()
    run = _Run(out, epochs=epochs, step_sleep=step_sleep, ranks=ranks)
    try:
        run.start(0)
        run.start(1)
        codes = run.wait_all(time.monotonic() + TIMEOUT)
        assert codes == {0: 0, 1: 0}, run.log(0)[-3000:] + run.log(1)[-3000:]
    finally:
        run.close()
    return [torch.load(out / f"result_{group}.pt") for group in (0, 1)]


@pytest.mark.slow
def test_no_fault_equals_plain_ddp(tmp_path: Path) -> None:
    (tmp_path / "ddp").mkdir()
    oracle = _ddp_oracle(tmp_path / "ddp", epochs=3)
    out = tmp_path / "ft"
    # step_sleep: long enough for a 1% check of goodput
    for result in _without_faults(out, epochs=3, step_sleep=0.1):
        for key, value in oracle["weights"].items():
            assert torch.equal(result["weights"][key], value), key
        assert result["lr"] == oracle["lr"] and result["step"] == oracle["step"] == 18
        assert [entry[3:] for entry in result["ledger"]] == [[0, 1]] * 18
        _check_every_sample_once(result["ledger"], epochs=3)
        seconds = sum(result["goodput"]["seconds"].values())
        wall = result["ended"] - result["started"]
        assert abs(seconds - wall) <= 0.01 * wall, (seconds, wall)
    _check_logs_once_each(out, oracle, epochs=3)


def _all_reduce_cues(run: _Run, group: int) -> int:
    return run.log(group).count("ft_train: entering the all-reduce")


def _kill_inside_all_reduce(run: _Run, victim: int, deadline: float) -> None:
    """SIGSTOP the victim as it enters the all-reduce (past the quorum: its peer waits for
    it inside the all-reduce), give the peer time to get there, and SIGKILL the victim."""
    seen = _all_reduce_cues(run, victim)
    while _all_reduce_cues(run, victim) == seen:
        assert time.monotonic() < deadline, "the run stalled"
        if run.processes[victim].poll() is not None:
            return
        time.sleep(0.005)
    run.signal(victim, signal.SIGSTOP)
    time.sleep(0.4)  # the all-reduce's sleep is 0.1 s: the peer is inside it now


def kill_campaign(out: Path, *, faults: int, epochs: int, seed: int, ranks: int = 1,
                  extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Two groups; ``faults`` SIGKILLs of one group at a time, each restarted after a
    delay, never while the other is still healing: the even faults at a random moment, the
    odd ones while the peer waits for the victim inside the all-reduce. Once the last
    victim is back and both groups trained since, the rest of the run goes without the
    steps' sleeps. Returns what the test checks."""
    chooser = random.Random(seed)
    run = _Run(out, epochs=epochs, step_sleep=0.15, ranks=ranks, extra=extra)
    deadline = time.monotonic() + TIMEOUT * ranks
    kills, inside = [], 0
    try:
        run.start(0)
        run.start(1)
        for fault in range(faults + 1):
            victim = fault % 2
            other = 1 - victim
            while run.commits(other) < 2 or run.commits(victim) < 2:  # both trained since
                assert time.monotonic() < deadline, "the run stalled"
                if 0 in [process.poll() for process in run.processes.values()]:
                    break  # the run ended
                assert run.processes[other].poll() is None, run.log(other)[-3000:]
                time.sleep(0.05)
            if 0 in [process.poll() for process in run.processes.values()]:
                break
            if fault == faults:  # the last victim healed and trained: no kill is left, so
                (out / "fast").touch()  # the steps stop sleeping (ft_train.py's _Slow)
                break
            if fault % 2:
                _kill_inside_all_reduce(run, victim, deadline)
                inside += 1
            else:
                time.sleep(chooser.uniform(0.0, 1.0))
            if run.processes[victim].poll() is not None:
                break  # the run ended
            run.signal(victim, signal.SIGKILL)
            run.processes[victim].wait()
            kills.append(time.monotonic())
            time.sleep(chooser.uniform(0.2, 1.5))
            if run.processes[other].poll() is not None:
                del run.processes[victim]  # the survivor finished the run alone
                break
            run.start(victim)
        codes = run.wait_all(deadline)
        logs = {group: run.log(group) for group in run.processes}
        for group, code in list(codes.items()):
            # restarted just as the other group ended the run: refused, as it must be
            if code != 0 and "has no live peer" in logs[group] and 0 in codes.values():
                del codes[group]
        assert set(codes.values()) == {0}, "\n".join(log[-3000:] for log in logs.values())
        survivor_restarts = sum(run.starts.values()) - 2 - len(kills) + (len(run.processes) < 2)
        retried = sum(path.read_text().count("failed (a peer left inside it)")
                      for path in out.glob("group*.log"))
    finally:
        run.close()
    return {"kills": len(kills), "inside": inside, "survivor_restarts": survivor_restarts,
            "retried": retried,
            "results": [torch.load(out / f"result_{group}.pt") for group in codes]}


def _check_goodput(result: dict[str, Any], earliest_start: float) -> None:
    """The buckets add up to the wall time measured outside the callback, within 1%."""
    seconds = sum(result["goodput"]["seconds"].values())
    assert result["ended"] - result["started"] <= seconds * 1.01  # the last launch's fit
    assert seconds <= (result["ended"] - earliest_start) * 1.01, (seconds, result)


@pytest.mark.slow
def test_random_kills_train_every_sample_once_and_equal_the_fault_free_run(
        tmp_path: Path) -> None:
    (tmp_path / "ddp").mkdir()
    epochs = 80
    oracle = _ddp_oracle(tmp_path / "ddp", epochs=epochs)
    (tmp_path / "ft").mkdir()
    started = time.time()
    campaign = kill_campaign(tmp_path / "ft", faults=10, epochs=epochs, seed=35)
    assert campaign["kills"] >= 10 and campaign["inside"] >= 5
    assert campaign["survivor_restarts"] == 0
    assert campaign["retried"] >= 1, "no kill landed inside a step: the retry path never ran"
    for result in campaign["results"]:
        _check_every_sample_once(result["ledger"], epochs=epochs)
        assert result["step"] == oracle["step"]
        assert result["lr"] == oracle["lr"]
        for key, value in oracle["weights"].items():
            assert torch.allclose(result["weights"][key], value, atol=1e-5, rtol=0), key
        _check_goodput(result, started)
        counts = result["goodput"]["counts"]
        assert counts["retried"] >= 1 and counts["dropped"] >= 1 and counts["joined"] >= 1
    _check_logs_once_each(tmp_path / "ft", oracle, epochs=epochs)
    print("kill campaign:", {k: v for k, v in campaign.items() if k != "results"},
          "goodput:", campaign["results"][0]["goodput"])


def _wait_for(condition: Any, deadline: float, what: str) -> None:
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_group_with_no_live_peer_resumes_from_the_checkpoint_or_refuses(
        tmp_path: Path) -> None:
    """Both groups die. Group 1 (no Checkpoint) restarted alone refuses before its first
    batch; group 0 restarted alone resumes from its disk checkpoint at torchft's step of the
    file; group 1 then heals from it; group 0, restarted while group 1 lives, heals from the
    live peer although it has Checkpoint(resume=True). The run is still the fault-free one."""
    epochs = 20  # group 1 must still train when group 0, restarted last (5-10 s on a busy
    # machine), looks for a live peer
    (tmp_path / "ddp").mkdir()
    oracle = _ddp_oracle(tmp_path / "ddp", epochs=epochs)
    out = tmp_path / "ft"
    out.mkdir()
    run = _Run(out, epochs=epochs, step_sleep=0.1, checkpoint=True)
    deadline = time.monotonic() + TIMEOUT
    try:
        run.start(0)
        run.start(1)
        _wait_for(lambda: run.commits(0) >= 9 and run.commits(1) >= 9, deadline, "9 steps")
        for group in (0, 1):
            os.killpg(run.processes[group].pid, signal.SIGKILL)
            run.processes[group].wait()
        run.start(1)  # no peer, no checkpoint
        assert run.processes[1].wait(timeout=120) != 0
        assert "has no live peer to recover from" in run.log(1) and run.commits(1) == 0
        run.start(0)  # no peer, a checkpoint
        _wait_for(lambda: run.commits(0) >= 2, deadline, "group 0 to resume")
        assert "Checkpoint: resumed from" in run.log(0)
        run.start(1)  # heals from group 0
        _wait_for(lambda: run.commits(1) >= 1, deadline, "group 1 to heal")
        os.killpg(run.processes[0].pid, signal.SIGKILL)
        run.processes[0].wait()
        assert run.processes[1].poll() is None, "group 1 ended: the scenario needs more epochs"
        run.start(0)  # Checkpoint(resume=True), a live peer: the peer's state wins
        _wait_for(lambda: run.commits(0) >= 1 or run.processes[0].poll() is not None,
                  deadline, "group 0 to heal")
        (out / "fast").touch()  # no kill is left: the steps stop sleeping
        codes = run.wait_all(deadline)
        logs = run.log(0) + run.log(1)
        assert codes == {0: 0, 1: 0}, logs[-6000:]
        assert "Checkpoint: not resuming from" in run.log(0), run.log(0)[-3000:]
    finally:
        run.close()
    for group in (0, 1):
        result = torch.load(out / f"result_{group}.pt")
        _check_every_sample_once(result["ledger"], epochs=epochs)
        assert result["step"] == oracle["step"] and result["lr"] == oracle["lr"]
        for key, value in oracle["weights"].items():
            assert torch.allclose(result["weights"][key], value, atol=1e-5, rtol=0), key
        assert result["goodput"]["counts"]["resumed"] == 1
        assert result["goodput"]["seconds"]["restart"] > 0


@pytest.mark.slow
def test_grad_accumulation_beside_fault_tolerance_equals_the_fault_free_run(
        tmp_path: Path) -> None:
    """GradAccumulation(2) in both groups and in the oracle: a missing group's shards of
    every batch of the window are taken over, so a step with a fault trains the fault-free
    step's window. Two kills (one between steps, one inside the all-reduce)."""
    extra = ("--accumulate", "2")
    (tmp_path / "ddp").mkdir()
    epochs = 30
    oracle = _ddp_oracle(tmp_path / "ddp", epochs=epochs, extra=extra)
    (tmp_path / "ft").mkdir()
    campaign = kill_campaign(tmp_path / "ft", faults=2, epochs=epochs, seed=37, extra=extra)
    assert campaign["kills"] == 2 and campaign["survivor_restarts"] == 0
    for result in campaign["results"]:
        _check_every_sample_once(result["ledger"], epochs=epochs, window=2)
        assert any(entry[3:] != [0, 1] for entry in result["ledger"]), "no takeover ran"
        assert result["step"] == oracle["step"] == epochs * 3 and result["lr"] == oracle["lr"]
        for key, value in oracle["weights"].items():
            assert torch.allclose(result["weights"][key], value, atol=1e-5, rtol=0), key
    _check_logs_once_each(tmp_path / "ft", oracle, epochs=epochs)
