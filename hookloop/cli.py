"""The ``hookloop`` command: run a script on several processes, presets, the event table
of a stack, events, a checkpoint's weights exported as safetensors, version.

Examples::

    hookloop run --nproc 2 train.py --lr 0.1           # 2 processes, torchrun's standalone mode
    hookloop run --groups 2 train.py                  # 2 replica groups (FaultTolerance)
    hookloop presets                                  # what is installed, from which package
    hookloop presets check quick_cpu                  # run hookloop.testing on a preset
    hookloop describe standard                        # who runs at which event
    hookloop describe standard ema=None accumulate=4  # with arguments (Python literals)
    hookloop events                                   # the events in firing order
    hookloop export ckpt/best.pt model/               # the weights as safetensors (HF layout)
    hookloop version
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence
from typing import Any

from hookloop.errors import HookloopError

__all__ = ["main", "parse_assignment", "run_script"]

#: The signals ``hookloop run`` passes on to its workers: torchrun's own list, and SIGUSR1
#: (SLURM's ``--signal=USR1@...``: the training saves and the job is requeued).
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def _help_text(docstring: str | None) -> str:
    """A docstring as a terminal shows it: no reStructuredText markup."""
    return (docstring or "").replace("``", "").replace("::", ":")


def parse_assignment(text: str) -> tuple[str, Any]:
    """Split ``key=value`` and read the value as a Python literal, else keep the string.

    ``ema=None`` gives None, ``clip=0.5`` a float, ``metrics={'acc': 1}`` a dict, and
    ``checkpoint_dir=runs/a`` the string ``"runs/a"``.

    Raises:
        argparse.ArgumentTypeError: no ``=``, or a key that is not a Python identifier.

    Example:
        >>> parse_assignment("ema=None"), parse_assignment("checkpoint_dir=runs/a")
        (('ema', None), ('checkpoint_dir', 'runs/a'))
    """
    key, equals, value = text.partition("=")
    key = key.strip()
    if not equals or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not key=value; write for example ema=None or clip=0.5")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _print_presets() -> int:
    from hookloop.presets.registry import entries

    usable, problems = entries()
    rows = [(entry.name, entry.package, entry.description + _range(entry))
            for entry in [*usable.values(), *problems]]
    rows.sort(key=lambda row: (row[1] != "hookloop", row[0]))
    name_width = max(len("preset"), *(len(row[0]) for row in rows))
    package_width = max(len("package"), *(len(row[1]) for row in rows))
    print(f"{'preset':<{name_width}}  {'package':<{package_width}}  description")
    for name, package, description in rows:
        print(f"{name:<{name_width}}  {package:<{package_width}}  {description}")
    print("\nUse one: presets.get(NAME, **arguments); see its stack: hookloop describe NAME")
    return 0


def _check_preset(parser: argparse.ArgumentParser, name: str | None,
                  assignments: list[tuple[str, Any]]) -> int:
    from hookloop.testing import KitFailure, check_preset

    if not name:
        parser.error("hookloop presets check needs a preset name: hookloop presets check NAME")
    try:
        check_preset(name, **dict(assignments))
    except KitFailure as failure:
        print(f"hookloop presets check {name}: FAILED: {failure}", file=sys.stderr)
        return 1
    print(f"hookloop presets check {name}: every check of hookloop.testing passed (dispatch, "
          "declarations, state, resume).")
    return 0


def _range(entry: Any) -> str:
    """The hookloop versions a published preset supports, after its description."""
    if entry.package == "hookloop":
        return ""
    return f"  [hookloop {entry.requires or 'any version'}]"


def _describe(name: str, assignments: list[tuple[str, Any]]) -> int:
    from hookloop.engine.describe import describe
    from hookloop.presets.registry import get  # presets.get, from its module

    callbacks = get(name, **dict(assignments))
    arguments = ", ".join(f"{key}={value!r}" for key, value in assignments)
    print(f"presets.get({name!r}{', ' if arguments else ''}{arguments}):")
    print("[" + ", ".join(repr(callback) for callback in callbacks) + "]\n")
    print(describe(callbacks, print_table=False), end="")
    return 0


def run_script(nproc: int, script: str, arguments: Sequence[str] = ()) -> int:
    """Run ``script`` on ``nproc`` processes of this machine, as ``torchrun --standalone``.

    torch's own launcher (``torch.distributed.run``) starts the workers with torchrun's
    environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, a rendezvous on a free local
    port), so `DDP` and `FSDP` in the script find it as under ``torchrun``. SIGTERM, SIGINT,
    SIGHUP, SIGQUIT and SIGUSR1 sent to this process are passed on to every worker
    (`FORWARDED_SIGNALS`), which then end at an agreed step boundary with a checkpoint.

    Args:
        nproc: The number of worker processes (one per GPU on a GPU machine).
        script: The training script's path.
        arguments: The script's own arguments.

    Returns:
        The workers' status: 0 when all of them succeeded; else the status of the first
        worker that failed (``128 + N`` for a worker ended by signal N, as a shell reports
        it); ``128 + N`` when signal N ended the launch (143 for SIGTERM).
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    options = torchrun.parse_args(["--standalone", f"--nproc-per-node={nproc}",
                                   f"--signals-to-handle={FORWARDED_SIGNALS}", script,
                                   *arguments])
    try:
        torchrun.run(options)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        status = int(failure.exitcode)
        status = 128 - status if status < 0 else status  # -15 (killed by SIGTERM): 143
        print(f"hookloop run: worker {rank} of {nproc} (pid {failure.pid}) exited with status "
              f"{status} first; its output is above.", file=sys.stderr, flush=True)
        return status
    except SignalException as error:  # the workers got it too, and have ended
        return 128 + int(error.sigval)
    return 0


def _process_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(
            f"--nproc must be a number of processes (1, 2, ...), got {text!r}")
    return count


def _export(checkpoint: str, out_dir: str, ema: bool | str, max_shard_size: int | str) -> int:
    from hookloop.export import export_safetensors

    names = export_safetensors(checkpoint, out_dir, ema=ema, max_shard_size=max_shard_size)
    print(f"hookloop export: wrote {', '.join(names)} in {out_dir}")
    return 0


def _add_export(commands: Any) -> None:
    parser = commands.add_parser(
        "export", help="write a checkpoint's weights as safetensors (Hugging Face layout)",
        description="Read a checkpoint (a file, or a directory of shards written by any number "
                    "of ranks: put together in this process, on the CPU) with every check a "
                    "load makes, and write its model's weights (or its EMA's) in OUT_DIR as "
                    "model.safetensors, or past --max-shard-size as "
                    "model-0000k-of-0000n.safetensors with model.safetensors.index.json. "
                    "OUT_DIR must be new or empty. Local paths only for now.",
        epilog="example: hookloop export ckpt/epoch=0009-step=00001000.pt model --ema")
    parser.add_argument("checkpoint", help="a checkpoint file (.pt) or directory of shards (.dcp)")
    parser.add_argument("out_dir", help="the directory to write (new or empty)")
    parser.add_argument("--ema", nargs="?", const=True, default=False, metavar="NAME",
                        help="export the EMA's averaged weights (NAME: the EMA's name, for a "
                             "run with several)")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="split into several files past this size (default: 5GB, "
                             "Hugging Face's; also 500MB, 2GiB or bytes)")


def _group_count(text: str) -> int:
    try:
        return _process_count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"--groups must be a number of replica groups (1, 2, ...), got {text!r}") from None


def _fault_tolerance_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``hookloop run --groups``; the defaults are `hookloop.parallel.ft_plan`'s."""
    from hookloop.parallel import ft_plan

    parser.add_argument("--port", type=int, default=ft_plan.DEFAULT_LIGHTHOUSE_PORT,
                        help="with --groups: the lighthouse's port (0: a free one; "
                             f"default {ft_plan.DEFAULT_LIGHTHOUSE_PORT})")
    parser.add_argument("--heartbeat-timeout-ms", type=int,
                        default=ft_plan.DEFAULT_HEARTBEAT_TIMEOUT_MS,
                        help="with --groups: how long before a silent group is dropped (the "
                             "time to detect a group that died between steps; default "
                             f"{ft_plan.DEFAULT_HEARTBEAT_TIMEOUT_MS})")
    parser.add_argument("--run-dir", default=ft_plan.DEFAULT_RUN_DIR,
                        help="with --groups: where each group records its last committed step "
                             f"(default {ft_plan.DEFAULT_RUN_DIR})")
    parser.add_argument("--max-restarts", type=int, default=ft_plan.DEFAULT_MAX_RESTARTS,
                        help="with --groups: group restarts allowed in all (default "
                             f"{ft_plan.DEFAULT_MAX_RESTARTS})")
    parser.add_argument("--restart-delay", type=float, default=ft_plan.DEFAULT_RESTART_DELAY_S,
                        help="with --groups: seconds before a dead group is started again "
                             f"(default {ft_plan.DEFAULT_RESTART_DELAY_S:g})")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hookloop`` console script; ``hookloop --help`` lists the commands.

    Args:
        argv: The arguments after the command name; None reads ``sys.argv``.

    Returns:
        The exit status: 0 on success, 1 for an error hookloop reports (an unknown
        preset, a bad argument), 2 for bad usage.

    Example:
        >>> main(["version"])  # doctest: +ELLIPSIS
        hookloop ... (torch ...)
        0
    """
    parser = argparse.ArgumentParser(
        prog="hookloop", description=_help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run_parser = commands.add_parser(
        "run", help="run a training script on several processes (torchrun's standalone mode)",
        description="Start NPROC processes of the script on this machine with torch's own "
                    "launcher (torch.distributed.run --standalone --nproc-per-node NPROC), "
                    "as torchrun would: DDP and FSDP in the script find the processes. "
                    f"Signals ({FORWARDED_SIGNALS}) are passed on to every worker. The exit "
                    "status is the workers': 0, or the first failed worker's status "
                    "(128+N for signal N).",
        epilog="example: hookloop run --nproc 2 train.py --epochs 10")
    run_parser.add_argument("--nproc", type=_process_count, default=None,
                            help="processes to start (default: the number of GPUs, else 1)")
    run_parser.add_argument(
        "--groups", type=_group_count, default=None,
        help="fault tolerance: start a torchft lighthouse and GROUPS replica groups (one "
             "process each, FaultTolerance in the script), each restarted when it dies")
    _fault_tolerance_options(run_parser)
    run_parser.add_argument("script", help="the training script")
    run_parser.add_argument("arguments", nargs=argparse.REMAINDER,
                            help="the script's own arguments")
    presets_parser = commands.add_parser(
        "presets", help="list the presets: built-in and installed by other packages",
        description="List every preset presets.get() can build: its name, the package it "
                    "comes from, a one-line description and the hookloop versions it "
                    "supports. Installed presets that cannot be used are listed with the "
                    "reason. `hookloop presets check NAME` runs hookloop.testing's checks "
                    "on the preset's stack.",
        epilog="example: hookloop presets check quick_cpu clip=0.5")
    presets_parser.add_argument("action", nargs="?", choices=["check"],
                                help="check: run the test kit on the preset NAME")
    presets_parser.add_argument("name", nargs="?", help="the preset to check")
    presets_parser.add_argument("arguments", nargs="*", type=parse_assignment,
                                metavar="key=value", help="arguments of the preset")
    describe_parser = commands.add_parser(
        "describe", help="print the event table of a preset's stack",
        description="Build a preset and print which callback runs at which event, in "
                    "firing order. Arguments are key=value pairs; values are read as Python "
                    "literals (None, 0.5, 'bf16', {'a': 1}) and kept as text otherwise.",
        epilog="example: hookloop describe standard ema=None accumulate=4 tensorboard=None")
    describe_parser.add_argument("preset", help="a preset name, as listed by `hookloop presets`")
    describe_parser.add_argument("arguments", nargs="*", type=parse_assignment,
                                 metavar="key=value", help="arguments of the preset")
    _add_export(commands)
    commands.add_parser("events", help="print the loop's events in firing order",
                        description="Print the events in firing order with what each guarantees.")
    commands.add_parser("version", help="print the versions of hookloop and torch",
                        description="Print the versions of hookloop and torch.")
    args = parser.parse_args(argv)
    if args.command == "run" and args.groups is not None:
        from hookloop.parallel.ft_launch import run_groups

        if args.nproc not in (None, 1):
            parser.error("hookloop run: --groups starts one process per replica group; "
                         "drop --nproc (groups of several processes are not supported yet)")
        return run_groups(args.groups, args.script, args.arguments, port=args.port,
                          heartbeat_timeout_ms=args.heartbeat_timeout_ms, run_dir=args.run_dir,
                          max_restarts=args.max_restarts, restart_delay=args.restart_delay)
    if args.command == "run":
        nproc = args.nproc
        if nproc is None:
            import torch

            nproc = max(1, torch.cuda.device_count())
        return run_script(nproc, args.script, args.arguments)
    try:
        if args.command == "presets" and args.action == "check":
            return _check_preset(parser, args.name, args.arguments)
        if args.command == "presets":
            return _print_presets()
        if args.command == "describe":
            return _describe(args.preset, args.arguments)
        if args.command == "export":
            size = args.max_shard_size
            return _export(args.checkpoint, args.out_dir, args.ema,
                           int(size) if size.isdigit() else size)
    except HookloopError as error:
        print(f"hookloop {args.command}: error: {error}", file=sys.stderr)
        return 1
    if args.command == "version":
        import torch

        import hookloop

        print(f"hookloop {hookloop.__version__} (torch {torch.__version__})")
    elif args.command == "events":
        from hookloop.base.events import Event

        print(Event.__doc__)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
