"""Checkpoint writes in the background: the training step waits only for a copy of the
state in host memory; the file is written by a thread, at most one at a time.

`host_copy` copies every tensor of a payload into new host memory (pinned, from CUDA, and
without waiting for each copy: one synchronization at the end), keeping the storages that
tensors share shared, so the file written from the copy is the file a synchronous save
writes. `BackgroundWriter` runs one write at a time in a thread: a second `submit` waits
for the first; what completed is handed back in the main thread (`poll`, `wait`), where a
failure is raised, named with its file, at the next step boundary. Writes stay atomic (a
temporary file renamed once complete), so a kill during a background write leaves the
earlier files and at most a temporary file, as a synchronous save does.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hookloop import distributed
from hookloop.base.checks import check_flag
from hookloop.errors import CheckpointWriteError
from hookloop.parallel.suspension import TimedSaves
from hookloop.runfile.checkpoint_files import CheckpointFiles
from hookloop.runfile.sharded import contains_shards, is_sharded_tensor, saves_shards
from hookloop.runfile.weights import finite_model_state, non_finite_weights_advice, run_is_finite

__all__ = ["host_copy", "BackgroundWriter", "RotatingWrites", "agree_outcome", "raise_agreed"]


def host_copy(payload: Any) -> Any:
    """``payload`` with every tensor copied into new host memory (nested dicts, lists,
    tuples); other values are kept. Tensors that share a storage share its copy.

    Example:
        >>> weight = torch.ones(4)
        >>> copied = host_copy({"model": {"w": weight, "head": weight[:2]}, "step": 3})
        >>> weight.add_(1.0)[0].item(), copied["model"]["w"][0].item(), copied["step"]
        (2.0, 1.0, 3)
        >>> copied["model"]["head"].untyped_storage().data_ptr() == \\
        ...     copied["model"]["w"].untyped_storage().data_ptr()
        True
    """
    storages: dict[tuple[str, int], torch.Tensor] = {}
    copied = _copy(payload, storages)
    if torch.cuda.is_available() and any(host.is_pinned() for host in storages.values()):
        torch.cuda.synchronize()  # the non-blocking copies are complete
    return copied


def _copy(value: Any, storages: dict[tuple[str, int], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return _copy_tensor(value, storages)
    if isinstance(value, dict):
        return type(value)((key, _copy(item, storages)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_copy(item, storages) for item in value)
    return value


def _copy_tensor(tensor: torch.Tensor, storages: dict[tuple[str, int], torch.Tensor]
                 ) -> torch.Tensor:
    if is_sharded_tensor(tensor):  # a shard stays a DTensor, its local part on the host
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return BlockingAsyncStager().stage({"shard": tensor})["shard"]
    tensor = tensor.detach()
    if tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_meta:
        return tensor.cpu().clone()  # sparse and other layouts: a plain copy, unshared
    storage = tensor.untyped_storage()
    key = (tensor.device.type, storage.data_ptr())
    host = storages.get(key)
    if host is None:
        pinned = tensor.is_cuda
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
        host.untyped_storage().copy_(storage, non_blocking=pinned)
        storages[key] = host
    view = torch.empty(0, dtype=tensor.dtype)
    return view.set_(host.untyped_storage(), tensor.storage_offset(), tensor.size(),
                     tensor.stride())


def agree_outcome(group: Any, *, done: bool, failed: bool) -> tuple[bool, bool]:
    """Every rank (a collective over ``group``): ``(over, failed)``: whether the background
    work is ``done`` on every rank, and whether it ``failed`` on one. On a gloo group in host
    memory: under nccl a device tensor read back each step would wait for the GPU's queue
    (a host-device sync per batch while a save runs)."""
    agreed = torch.tensor([0.0 if done else 1.0, 1.0 if failed else 0.0])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return agreed[0].item() == 0, agreed[1].item() > 0


def raise_agreed(own: BaseException | None, what: str) -> None:
    """Every rank, once `agree_outcome` said a rank failed: the rank whose failure ``own``
    is raises it, the others a `CheckpointWriteError` naming that rank, ``what`` failed
    (``"the background save"``) and the cause (a collective: the ranks learn each
    other's cause)."""
    told = distributed.all_gather_object(None if own is None else str(own))
    if own is not None:
        raise own
    rank, said = next((rank, text) for rank, text in enumerate(told) if text is not None)
    raise CheckpointWriteError(
        f"Checkpoint: {what} failed on rank {rank}, so this rank stops too (every rank "
        f"stops at the same step): {said}")


class BackgroundWriter:
    """One write at a time in a thread; its outcome handed back in the main thread.

    Example:
        >>> writer = BackgroundWriter()
        >>> done = []
        >>> writer.submit(lambda: "a.pt", on_done=done.append)
        >>> writer.wait()
        >>> done
        ['a.pt']
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._outcome: tuple[Any, BaseException | None] | None = None
        self._on_done: Callable[[Any], None] | None = None
        self._on_failure: Callable[[BaseException], None] | None = None

    def submit(self, write: Callable[[], Any], *, on_done: Callable[[Any], None] | None = None,
               on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Run ``write()`` in a thread, after the write in flight (if any) has finished and
        been handed back. ``on_done(result)`` or ``on_failure(error)`` run later, in the
        main thread, from `poll` or `wait`; the error is raised there too."""
        self.wait()
        self._on_done, self._on_failure = on_done, on_failure

        def run() -> None:
            try:
                self._outcome = (write(), None)
            except BaseException as error:  # handed to the main thread, raised there
                self._outcome = (None, error)

        self._thread = threading.Thread(target=run, name="hookloop-checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        """Whether a write is running."""
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> None:
        """Hand back a write that finished (without waiting for one that did not)."""
        if self._thread is not None and not self._thread.is_alive():
            self._finish()

    def wait(self) -> None:
        """Wait for the write in flight, then hand it back."""
        if self._thread is not None:
            self._thread.join()
            self._finish()

    def _finish(self) -> None:
        assert self._thread is not None and self._outcome is not None
        self._thread.join()
        (result, error), self._outcome, self._thread = self._outcome, None, None
        on_done, on_failure, self._on_done, self._on_failure = (
            self._on_done, self._on_failure, None, None)
        if error is not None:
            if on_failure is not None:
                on_failure(error)
            raise error
        if on_done is not None:
            on_done(result)


class RotatingWrites:
    """How one `Checkpoint` writes its rotating files (`CheckpointFiles.write_resume`): now,
    or with ``background=True`` from a host copy in a thread, one at a time. Once a file is
    complete (in the main thread: `poll`, `wait`) it is `last_path` and the older files
    beyond ``keep_last`` are pruned; a failed write calls its ``failed()`` and is raised.

    Args:
        files: The checkpoint's files.
        keep_last: How many rotating files to keep (None: all).
        background: Write in a thread (``Checkpoint(async_save=True)``).
    """

    def __init__(self, files: CheckpointFiles | str, keep_last: int | None, *, background: bool,
                 prefix: str = "", monitor: str | None = None,
                 every_n_seconds: float | None = None) -> None:
        """``files``: the directory's `CheckpointFiles`, or its path (``prefix`` and
        ``monitor`` name its files then); ``every_n_seconds``: the clock of timed saves
        (`timed`)."""
        #: When a timed save is due, agreed by every rank (`TimedSaves`).
        self.timed = TimedSaves(every_n_seconds, owner="Checkpoint")
        self.files = files if isinstance(files, CheckpointFiles) else CheckpointFiles(
            files, prefix, monitor)
        self.keep_last = keep_last
        self._writer = BackgroundWriter() if check_flag("Checkpoint async_save",
                                                        background) else None
        self._side: tuple[Any, Any, Any] | None = None  # (default group, 2 gloo twins)
        self._pending = False  # several ranks: a write's outcome is not agreed yet
        self._failure: BaseException | None = None  # this rank's, until agreed
        self._warned_not_finite = False
        self._shards: bool | None = None  # whether the fit's saves hold shards (`follow`)
        #: Path of the newest complete rotating checkpoint written (or resumed from).
        self.last_path: str | None = None

    def save(self, run: dict[str, Any], epoch: int, step: int, metrics: dict[str, float], *,
             failed: Callable[[], None], now: bool = False, callbacks: Sequence[Any] = ()
             ) -> bool:
        """Write ``run`` (`Loop.state_dict`) as the file of ``epoch`` and ``step``; every rank
        calls it (rank 0 writes a file; every rank its shards of a directory). In the
        background unless ``now`` (the exception path) or on a rank that writes nothing. A
        directory of shards is written by every rank's thread together, over a gloo group
        of its own (`side_group`), so its collectives never meet the training's. A write
        in flight is waited for first. Whether ``run`` holds shards was decided at the fit's
        start (`follow`), not by a search of ``run`` at each save (the search is only for a
        caller that never called `follow`).

        Returns:
            False, writing nothing, where the weights are not finite (every rank skips, or
            none; warned once, with advice for the stack ``callbacks``); else True.
        """
        shards = contains_shards(run) if self._shards is None else self._shards
        if not run_is_finite(run, agree=not now, sharded=shards):
            if not self._warned_not_finite and distributed.is_main():
                warnings.warn(f"Checkpoint: the weights at epoch {epoch}, step {step} are not "
                              "finite (NaN/inf); no checkpoint written, the older files are "
                              "kept. " + non_finite_weights_advice(callbacks), RuntimeWarning,
                              stacklevel=3)
                self._warned_not_finite = True
            return False
        metrics = dict(metrics)
        if self._writer is None or now or not (shards or distributed.is_main()):
            self.wait(raising=not now)  # now: the exception path drained it, no collective
            try:
                path = self.files.write_resume(run, epoch, step, metrics, shards=shards)
            except BaseException:
                failed()
                raise
            if path is not None:
                self._written(path)
            self._pending = self._writer is not None and not now and self._agreeing()
            return True
        group = self._side_group() if shards and distributed.is_initialized() else None
        self.wait()
        copied = host_copy(run)  # what the training step waits for

        def write() -> str | None:
            return self.files.write_resume(copied, epoch, step, metrics, group=group,
                                           shards=shards)

        self._writer.submit(write, on_failure=lambda error: failed(),
                            on_done=lambda path: None if path is None else self._written(path))
        self._pending = self._agreeing()
        return True

    def follow(self, model: Any) -> None:
        """At a fit's start, its model wrapped by now: whether its saves hold shards, decided
        once (`hookloop.runfile.sharded.saves_shards`) instead of at each save."""
        self._shards = saves_shards(model)

    def best_weights(self, module: Any) -> dict[str, Any] | None:
        """Before a best file: wait for the rotating write in flight (which rotating files
        exist decides what a dropped entry sets aside), then ``module``'s state as a best file
        holds it (gathered, or shards under FSDP), or None where it is not finite (every
        rank calls it and gets the same answer)."""
        self.wait()
        return finite_model_state(module)

    @staticmethod
    def _agreeing() -> bool:
        """Whether the ranks agree on each background write's outcome (several ranks)."""
        return distributed.is_initialized() and distributed.world_size() > 1

    def agreement_group(self) -> Any:
        """The gloo group the main thread agrees over (`agree_outcome`), every rank."""
        return self._side_group(agreeing=True)

    def _side_group(self, *, agreeing: bool = False) -> Any:
        """A gloo group over every rank for the background writes of shards, and one for
        the main thread's agreement on their outcome (two threads must never share a group:
        their collectives would interleave in different orders on different ranks). Made
        once per default group, both at once, by every rank at the same point
        (`new_group` is a collective)."""
        world = dist.group.WORLD
        if self._side is None or self._side[0] is not world:
            self._side = (world, dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
        return self._side[2 if agreeing else 1]

    def _written(self, path: str) -> None:
        self.last_path = path
        self.files.prune_rotating(path, self.keep_last)  # only now that the new one is complete

    def poll(self) -> None:
        """At a step boundary: finish a write that completed; raise one that failed.

        On several ranks every rank learns at the same boundary that the write is over on
        all of them (one small all-reduce per step while a write is in flight, from the
        main thread, over a gloo group in host memory), and then each raises a
        failure: the rank whose write failed its own error, the others a
        `CheckpointWriteError` naming that rank and its cause."""
        if self._writer is None:
            return
        if not (self._pending and self._agreeing()):
            self._writer.poll()
            return
        self._agree(done=not self._writer.busy())

    def wait(self, *, raising: bool = True) -> None:
        """Wait for the write in flight; ``raising=False`` drops its failure and takes no
        collective (the exception path: the other ranks may be gone; it saves that
        position again)."""
        if self._writer is None:
            return
        if self._pending and raising and self._agreeing():  # the group is still up
            self._agree(done=True)
            return
        self._pending, failure, self._failure = False, self._failure, None
        if failure is not None and raising:
            raise failure
        try:
            self._writer.wait()
        except Exception:
            if raising:
                raise

    def _agree(self, *, done: bool) -> None:
        """Every rank: is every rank's write over, and did one fail? Then hand it back."""
        if done:
            try:
                self._writer.wait()  # type: ignore[union-attr]
            except Exception as error:  # kept until every rank is over
                self._failure = error
        over, failed = agree_outcome(self.agreement_group(), done=done,
                                     failed=self._failure is not None)
        if not over:  # a rank's write is still in flight: ask at the next step
            return
        own, self._failure, self._pending = self._failure, None, False
        if failed:
            raise_agreed(own, "the background save")

    def close(self, *, release: bool) -> None:
        """At fit end: wait for the write in flight, then (``release``: rank 0) give the
        directory back, also when that write failed."""
        try:
            self.wait()
        finally:
            if release:
                self.files.release()
