"""FaultTolerance with real processes: a torchft lighthouse on a free port, two replica groups
as processes, SIGKILLs at random moments, and plain 2-rank DDP (torchrun) as the oracle.

One launch per scenario, every process with a timeout: a hang is a failure.
"""

from __future__ import annotations

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
TIMEOUT = 480  # seconds for a whole scenario


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return int(probe.getsockname()[1])


class _Run:
    """A lighthouse and the replica groups of one scenario, all killed at the end."""

    def __init__(self, out: Path, *, epochs: int, step_sleep: float, groups: int = 2,
                 checkpoint: bool = False) -> None:
        self.out, self.groups, self.processes = out, groups, {}
        self.args = ["ft", str(out), "--step-sleep", str(step_sleep)]
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
        self.processes[group] = subprocess.Popen(
            [sys.executable, str(SCRIPT), *self.args], cwd=ROOT, env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)

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
        for process in [*self.processes.values(), self.lighthouse]:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _ddp_oracle(out: Path, epochs: int) -> dict[str, Any]:
    env = subprocess_env()
    env["FT_TEST_EPOCHS"] = str(epochs)
    env.pop("RANK", None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPT), "ddp", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return torch.load(out / "result_0.pt")


def _check_every_sample_once(ledger: list[list[int]], epochs: int) -> None:
    from ft_train import BATCH, SAMPLES

    from hookloop.parallel.ft_plan import shard_indices

    steps = [entry[0] for entry in ledger]
    assert steps == list(range(len(ledger))), "each committed step once, in order"
    trained: dict[int, list[int]] = {epoch: [] for epoch in range(epochs)}
    for _, epoch, batch, *plan in ledger:
        for shard in range(len(plan)):
            # the loader's seed: its generator's (ft_train.py seeds it with 7)
            trained[epoch] += shard_indices(SAMPLES, len(plan), shard, epoch=epoch,
                                            batch=batch, batch_size=BATCH, shuffle=True,
                                            seed=7)
    for epoch, samples in trained.items():
        assert sorted(samples) == list(range(SAMPLES)), f"epoch {epoch}: {sorted(samples)}"


@pytest.mark.slow
def test_no_fault_equals_plain_ddp(tmp_path: Path) -> None:
    (tmp_path / "ddp").mkdir()
    oracle = _ddp_oracle(tmp_path / "ddp", epochs=3)
    out = tmp_path / "ft"
    out.mkdir()
    run = _Run(out, epochs=3, step_sleep=0.0)
    try:
        run.start(0)
        run.start(1)
        codes = run.wait_all(time.monotonic() + TIMEOUT)
        assert codes == {0: 0, 1: 0}, run.log(0)[-3000:] + run.log(1)[-3000:]
    finally:
        run.close()
    for group in (0, 1):
        result = torch.load(out / f"result_{group}.pt")
        for key, value in oracle["weights"].items():
            assert torch.equal(result["weights"][key], value), key
        assert result["lr"] == oracle["lr"] and result["step"] == oracle["step"] == 18
        assert [entry[3:] for entry in result["ledger"]] == [[0, 1]] * 18
        _check_every_sample_once(result["ledger"], epochs=3)


def kill_campaign(out: Path, *, faults: int, epochs: int, seed: int) -> dict[str, Any]:
    """Two groups; ``faults`` SIGKILLs of one group at a time at random moments, each
    restarted after a delay, never while the other is still healing. Returns what the
    test checks."""
    chooser = random.Random(seed)
    run = _Run(out, epochs=epochs, step_sleep=0.15)
    deadline = time.monotonic() + TIMEOUT
    kills, survivor_restarts = [], 0
    try:
        run.start(0)
        run.start(1)
        for fault in range(faults):
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
            time.sleep(chooser.uniform(0.0, 1.0))
            if run.processes[victim].poll() is not None:
                break  # the run ended
            os.killpg(run.processes[victim].pid, signal.SIGKILL)
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
    finally:
        run.close()
    return {"kills": len(kills), "survivor_restarts": survivor_restarts,
            "results": [torch.load(out / f"result_{group}.pt") for group in codes]}


@pytest.mark.slow
def test_random_kills_train_every_sample_once_and_equal_the_fault_free_run(
        tmp_path: Path) -> None:
    (tmp_path / "ddp").mkdir()
    epochs = 80
    oracle = _ddp_oracle(tmp_path / "ddp", epochs=epochs)
    (tmp_path / "ft").mkdir()
    campaign = kill_campaign(tmp_path / "ft", faults=10, epochs=epochs, seed=35)
    assert campaign["kills"] >= 10
    assert campaign["survivor_restarts"] == 0
    for result in campaign["results"]:
        _check_every_sample_once(result["ledger"], epochs=epochs)
        assert result["step"] == oracle["step"]
        assert result["lr"] == oracle["lr"]
        for key, value in oracle["weights"].items():
            assert torch.allclose(result["weights"][key], value, atol=1e-5, rtol=0), key
