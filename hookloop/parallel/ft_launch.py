"""``hookloop run --groups N``: a torchft lighthouse and N replica groups on this machine,
each group restarted when it dies.

The lighthouse runs inside this process (torchft's ``LighthouseServer``); each replica group
is one process of the training script, told its group, the number of groups, the
lighthouse's address and the run directory through the variables of
`hookloop.parallel.ft_plan`. A group that exits with a failure is started again after
``restart_delay`` seconds (at most ``max_restarts`` times in all), unless another group
already finished the run: the others never restart for it. SIGTERM and SIGINT end every
group and the launch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from hookloop.errors import ConfigurationError
from hookloop.parallel import ft_plan

__all__ = ["run_groups"]


def _lighthouse(port: int, heartbeat_timeout_ms: int) -> Any:
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as error:
        raise ConfigurationError(
            "hookloop run --groups needs torchft: pip install 'hookloop[ft]' "
            f"(importing it failed: {error}).") from error
    return LighthouseServer(bind=f"[::]:{port}", min_replicas=1,
                            join_timeout_ms=ft_plan.DEFAULT_JOIN_TIMEOUT_MS,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)


def _say(text: str) -> None:
    print(f"hookloop run: {text}", file=sys.stderr, flush=True)


def run_groups(groups: int, script: str, arguments: Sequence[str] = (), *,
               port: int = ft_plan.DEFAULT_LIGHTHOUSE_PORT,
               heartbeat_timeout_ms: int = ft_plan.DEFAULT_HEARTBEAT_TIMEOUT_MS,
               run_dir: str = ft_plan.DEFAULT_RUN_DIR,
               max_restarts: int = ft_plan.DEFAULT_MAX_RESTARTS,
               restart_delay: float = ft_plan.DEFAULT_RESTART_DELAY_S) -> int:
    """Start a lighthouse and ``groups`` processes of ``script``; restart those that die.

    Args:
        groups: How many replica groups (one process each).
        script: The training script (its stack has ``FaultTolerance()``).
        arguments: The script's own arguments.
        port: The lighthouse's port (0: a free one).
        heartbeat_timeout_ms: How long the lighthouse waits for a silent group's heartbeat
            before it drops it: the time to detect a group that died between steps.
        run_dir: Where each group records its last committed step (`FaultTolerance`'s
            ``run_dir``: a group that restarts with no live peer and no checkpoint refuses).
        max_restarts: How many restarts in all, over every group, before the launch fails.
        restart_delay: Seconds before a dead group is started again.

    Returns:
        0 when the run finished (a group ended it with status 0); else the status of the
        group that failed once ``max_restarts`` were used, or ``128 + N`` for signal N.
    """
    server = _lighthouse(port, heartbeat_timeout_ms)
    env = dict(os.environ, **{ft_plan.ENV_GROUPS: str(groups),
                              ft_plan.ENV_LIGHTHOUSE: server.address(),
                              ft_plan.ENV_RUN_DIR: os.path.abspath(run_dir)})
    command = [sys.executable, script, *arguments]
    processes: dict[int, subprocess.Popen[bytes]] = {}
    ended: list[int] = []  # signals received

    def start(group: int) -> None:
        processes[group] = subprocess.Popen(command, env={**env, ft_plan.ENV_GROUP: str(group)})
        _say(f"replica group {group} of {groups} started (pid {processes[group].pid}), "
             f"lighthouse {server.address()}")

    previous = {number: signal.signal(number, lambda got, _: ended.append(got))
                for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        _say(f"lighthouse at {server.address()} (heartbeat timeout {heartbeat_timeout_ms} ms)")
        for group in range(groups):
            start(group)
        return _watch(processes, start, groups, ended, max_restarts, restart_delay)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
                process.wait()
        for number, handler in previous.items():
            signal.signal(number, handler)
        server.shutdown()


def _watch(processes: dict[int, subprocess.Popen[bytes]], start: Any, groups: int,
           ended: list[int], max_restarts: int, restart_delay: float) -> int:
    """Poll the groups until the run finished, restarting the dead ones."""
    finished: set[int] = set()
    restarts = 0
    while len(finished) < groups:
        if ended:
            for process in processes.values():
                if process.poll() is None:
                    process.send_signal(ended[0])
            for process in processes.values():
                process.wait()
            return 128 + int(ended[0])
        for group, process in list(processes.items()):
            status = process.poll()
            if status is None or group in finished:
                continue
            if status == 0 or finished:  # the run is over: a late failure changes nothing
                finished.add(group)
                if status:
                    _say(f"replica group {group} exited with status {status} after the run "
                         "finished; not restarted")
                continue
            if restarts >= max_restarts:
                _say(f"replica group {group} exited with status {status}; {max_restarts} "
                     "restarts used, giving up")
                return status if status > 0 else 128 - status
            restarts += 1
            _say(f"replica group {group} exited with status {status}; restarting it in "
                 f"{restart_delay:g} s (restart {restarts} of {max_restarts})")
            time.sleep(restart_delay)
            start(group)
        time.sleep(0.1)
    return 0
