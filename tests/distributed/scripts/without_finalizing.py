"""Run a torchrun script as ``__main__``, then exit without the interpreter's finalization.

``python -m torch.distributed.run without_finalizing.py SCRIPT ARGS...`` runs SCRIPT with
ARGS as its command line. When it ends, the non-daemon threads are joined and the exit handlers run as at any exit (hookloop's
process-group destruction among them), the output is flushed, and the process exits with
the status Python would give: 0, a `SystemExit`'s code (hookloop's `Suspended` included), 1
after a traceback, or death by SIGINT after a Ctrl-C.

Why: with gloo, a worker thread of a process group that is still referenced when the
interpreter finalizes (a DDP model held by the script's globals keeps it) can take the GIL
during finalization; Python then ends that thread with pthread_exit and the C++ runtime
aborts the process ("terminate called without an active exception", SIGABRT) after the
script has finished and written everything. It happened in about one clean-clone CI run
in three on 2 busy cores (torch 2.13; pytorch/pytorch#190489 and the abandoned #179291).
Skipping the finalization removes the race; nothing the tests read is written there.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import threading


def _status(exit: SystemExit) -> int:
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)
    return 1


def _report(error: BaseException) -> None:
    """What Python does with an uncaught exception: ``sys.last_*`` (hookloop's exit handler
    reads it: no collective after a failure), then ``sys.excepthook``."""
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
    sys.excepthook(type(error), error, error.__traceback__)


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    interrupted = False
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit:
        status = _status(exit)
    except BaseException as error:
        _report(error)
        status, interrupted = 1, isinstance(error, KeyboardInterrupt)
    threading._shutdown()  # type: ignore[attr-defined]  # what Python does first: join the threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


if __name__ == "__main__":
    main()
