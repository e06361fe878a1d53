"""SLURM: the task ``srun`` started (rank, world, address and port of the group), the
requeue of the job at the end of a launch, and the job's end time (`job_end_time`).

``srun`` starts every task itself (no torchrun) and describes it in variables: the global
rank ``SLURM_PROCID``, the number of tasks of the step ``SLURM_STEP_NUM_TASKS`` (or
``SLURM_NTASKS``), the rank on the node ``SLURM_LOCALID``, and the nodes in SLURM's
compressed host-list syntax (``SLURM_STEP_NODELIST`` or ``SLURM_JOB_NODELIST``, e.g.
``node[01-04,07]``). `srun_task` reads them; the group's address is the first node (where
task 0 runs with srun's default block distribution) and its port is derived from the job
id, so every task of a job computes the same one and two jobs on a node rarely meet. A
batch script's own shell is not a task ``srun`` started (``SLURM_STEP_ID`` is unset, or is
the batch step's): a script run there trains in one process, whatever ``--ntasks`` says.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import NamedTuple

from hookloop.errors import ConfigurationError
from hookloop.parallel.suspension import SIGUSR1, Suspension

__all__ = ["SlurmTask", "expand_hostlist", "first_host", "srun_task", "adopt_srun_task",
           "port_for_job", "requeue_id", "check_scontrol", "requeue", "requeue_on_sigusr1",
           "job_end_time"]

_adopted: SlurmTask | None = None  # the task adopt_srun_task described in torchrun's variables
_BATCH_STEP = {"4294967294", "batch"}  # the batch script's step (0xfffffffe), not an srun task
_RANGE = re.compile(r"\[([^\]]*)\]")


class SlurmTask(NamedTuple):
    """One task of an ``srun`` step, as its variables describe it."""

    rank: int
    world_size: int
    local_rank: int
    address: str
    port: int
    job_id: str


def _split_top_level(text: str) -> list[str]:
    """Split at the commas and spaces outside brackets: ``"a[1,2],b c"`` -> ``["a[1,2]",
    "b", "c"]`` (some sites and tools write a node list separated by spaces)."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if (char == "," or char.isspace()) and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        current.append(char)
    parts.append("".join(current))
    return [part for part in (part.strip() for part in parts) if part]


def _expand_range(body: str) -> list[str]:
    values = []
    for item in body.split(","):
        start, _, end = item.strip().partition("-")
        if not end:
            values.append(start)
            continue
        width = len(start)  # "01-04": the zero padding of the first bound is kept
        values.extend(f"{number:0{width}d}" for number in range(int(start), int(end) + 1))
    return values


def expand_hostlist(text: str) -> list[str]:
    """The host names of a SLURM host list, in order.

    Hosts are separated by commas or by spaces (``"alpha beta"``), as Lightning reads them.

    Example:
        >>> expand_hostlist("node[01-03,07],gpu-a[8-9]")
        ['node01', 'node02', 'node03', 'node07', 'gpu-a8', 'gpu-a9']
        >>> expand_hostlist("rack[1-2]-n[1,3]")
        ['rack1-n1', 'rack1-n3', 'rack2-n1', 'rack2-n3']

    Raises:
        ConfigurationError: an unbalanced bracket or a bound that is not a number.
    """
    hosts: list[str] = []
    for part in _split_top_level(text):
        if part.count("[") != part.count("]"):
            raise ConfigurationError(f"SLURM host list {text!r}: unbalanced brackets in {part!r}.")
        names = [""]
        position = 0
        try:
            for match in _RANGE.finditer(part):
                prefix = part[position:match.start()]
                names = [name + prefix + value for name in names
                         for value in _expand_range(match.group(1))]
                position = match.end()
        except ValueError:
            raise ConfigurationError(f"SLURM host list {text!r}: {part!r} has a range that is "
                                     "not made of numbers.") from None
        hosts.extend(name + part[position:] for name in names)
    return hosts


def first_host(text: str) -> str:
    """The first host of a SLURM host list (without expanding the rest).

    Example:
        >>> first_host("node[07-09,01]")
        'node07'
        >>> first_host("alpha beta gamma")  # a list separated by spaces
        'alpha'
    """
    part = _split_top_level(text)[0]
    return expand_hostlist(re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"[\1]", part))[0]


def port_for_job(job_id: str) -> int:
    """The group's port for a job: in 15000-34999, the same on every task of the job.

    Example:
        >>> port_for_job("4242")
        19242
    """
    digits = re.sub(r"\D", "", job_id) or "0"
    return 15000 + int(digits) % 20000


def srun_task(environ: Mapping[str, str] | None = None) -> SlurmTask | None:
    """This process as a task ``srun`` started, or None (not under srun, or torchrun's
    variables are set: torchrun started it, and describes it itself).

    ``MASTER_ADDR`` and ``MASTER_PORT``, when set, win over the derived address and port.

    Example:
        >>> srun_task({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
        ...            "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
        ...            "SLURM_JOB_NODELIST": "node[3-4]"})
        SlurmTask(rank=1, world_size=4, local_rank=1, address='node3', port=15077, job_id='77')
    """
    env = os.environ if environ is None else environ
    if all(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None  # torchrun (also `srun torchrun ...`) describes its workers itself
    needed = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID")
    if any(not env.get(name) for name in needed) or env["SLURM_STEP_ID"] in _BATCH_STEP:
        return None
    world = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or \
        env.get("SLURM_NODELIST")
    if not world or not nodes:
        return None
    try:
        rank, size, local = int(env["SLURM_PROCID"]), int(world), int(env["SLURM_LOCALID"])
    except ValueError:
        return None
    address = env.get("MASTER_ADDR") or first_host(nodes)
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else port_for_job(env["SLURM_JOB_ID"])
    return SlurmTask(rank, size, local, address, port, env["SLURM_JOB_ID"])


def adopt_srun_task() -> SlurmTask | None:
    """When ``srun`` started this process (`srun_task`), describe it in torchrun's
    variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; ``MASTER_ADDR`` and
    ``MASTER_PORT`` unless set), so ``init_process_group("env://")`` and the rest of the
    script (``hookloop.distributed.rank()`` after the group is gone) see the task.

    Returns:
        The task, also at a later call once its variables are set (a second fit), or None
        (not an srun task: nothing is set).
    """
    global _adopted
    task = srun_task()
    if task is None:  # not srun's, or described already: the variables say which
        adopted = _adopted
        same = adopted is not None and (os.environ.get("RANK"), os.environ.get("WORLD_SIZE"),
                                        os.environ.get("LOCAL_RANK")) == (
            str(adopted.rank), str(adopted.world_size), str(adopted.local_rank))
        return adopted if same else None
    os.environ.update(RANK=str(task.rank), WORLD_SIZE=str(task.world_size),
                      LOCAL_RANK=str(task.local_rank))
    os.environ.setdefault("MASTER_ADDR", task.address)
    os.environ.setdefault("MASTER_PORT", str(task.port))
    _adopted = task
    return task


def requeue_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The id ``scontrol requeue`` takes for this job: ``ARRAYJOBID_TASKID`` for a task of
    an array job (its own ``SLURM_JOB_ID`` is not the array's), else ``SLURM_JOB_ID``.

    Example:
        >>> requeue_id({"SLURM_JOB_ID": "1207", "SLURM_ARRAY_JOB_ID": "1200",
        ...             "SLURM_ARRAY_TASK_ID": "7"})
        '1200_7'
        >>> requeue_id({"SLURM_JOB_ID": "1207"})
        '1207'
    """
    env = os.environ if environ is None else environ
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


def check_scontrol(owner: str) -> str:
    """The path of ``scontrol``, or a ConfigurationError naming it (``requeue=True`` needs
    it; inside a container it is often missing)."""
    path = shutil.which("scontrol")
    if path is None:
        raise ConfigurationError(
            f"{owner}(requeue=True): scontrol is not on PATH, so the job could not be "
            "requeued when SIGUSR1 ends the launch. Run where SLURM's commands are "
            "installed (inside a container: bind-mount scontrol and SLURM's configuration), "
            f"or pass requeue=False and resubmit the job yourself (its exit status is 138).")
    return path


def requeue(job: str) -> str | None:
    """Run ``scontrol requeue job``; None when it worked, else what went wrong (said, not
    raised: the launch is ending and its exit status must stay the documented one)."""
    try:
        done = subprocess.run([check_scontrol("hookloop"), "requeue", job], capture_output=True,
                              text=True, timeout=60, check=False)
    except (ConfigurationError, OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if done.returncode != 0:
        return (f"scontrol requeue {job} failed with status {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()}")
    return None


def requeue_on_sigusr1(owner: str, main: bool) -> Callable[[Suspension], None] | None:
    """The action that requeues this SLURM job when SIGUSR1 ended the launch (for
    `hookloop.parallel.suspension.Vote.at_end`), or None outside a SLURM job.

    Checks now that ``scontrol`` is there, so a missing one fails before the first batch.

    Args:
        owner: The callback asking (``"DDP"``, ``"FSDP"``), named in errors.
        main: Whether this process is rank 0, the one that requeues.

    Raises:
        ConfigurationError: ``scontrol`` is not on PATH.
    """
    job = requeue_id()
    if job is None:
        return None
    check_scontrol(owner)

    def act(suspension: Suspension) -> None:
        if not main or SIGUSR1.name not in suspension.causes:
            return
        problem = requeue(job)
        message = (f"{owner}: requeued SLURM job {job} (scontrol requeue); its next start "
                   "resumes from the checkpoint." if problem is None else
                   f"{owner}: the SLURM job {job} was not requeued: {problem}. Resubmit it; "
                   "it resumes from the checkpoint.")
        print(message, file=sys.stderr if problem else sys.stdout, flush=True)

    return act


def _unix_time(text: str) -> float | None:
    """SLURM's ``2026-12-01T23:00:00`` (local time) as Unix time; None for ``Unknown``,
    ``N/A``, ``NONE`` or anything else."""
    try:
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def job_end_time(environ: Mapping[str, str] | None = None, *,
                 ask: bool = True) -> float | None:
    """When SLURM ends this job (its time limit), as Unix time; None outside a SLURM job
    (no ``SLURM_JOB_ID``) or when it cannot be told.

    First ``SLURM_JOB_END_TIME`` (Unix time, set by recent SLURM versions), else
    ``squeue -h -j JOB -o %e``, else ``EndTime=`` of ``scontrol show job JOB``; with
    ``ask=False`` only the variable (no process runs: a caller asks once for every rank).

    Example:
        >>> job_end_time({"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": "1767225600"})
        1767225600.0
        >>> job_end_time({}) is None
        True
    """
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        return float(environ["SLURM_JOB_END_TIME"])
    except (KeyError, ValueError):
        if not ask:
            return None
    for command in (("squeue", "-h", "-j", job, "-o", "%e"), ("scontrol", "show", "job", job)):
        path = shutil.which(command[0])
        if path is None:
            continue
        try:
            done = subprocess.run([path, *command[1:]], capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode != 0:
            continue
        if command[0] == "squeue":
            lines = done.stdout.strip().splitlines()
            end = _unix_time(lines[0]) if lines else None
        else:
            match = re.search(r"\bEndTime=(\S+)", done.stdout)
            end = _unix_time(match.group(1)) if match else None
        if end is not None:
            return end
    return None
