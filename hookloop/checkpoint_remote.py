"""`Checkpoint` of an fsspec URL: ``Checkpoint("s3://bucket/run")``.

``Checkpoint(url, ...)`` makes an instance of a subclass (`remote_variant`) that saves
exactly as a local `Checkpoint` does, into a local staging directory, and mirrors that
directory to the URL (`hookloop.runfile.remote_mirror`): every rule of the local files
(atomic writes, verification, keep-last, top-k, best, rollback, async saves, shards)
holds unchanged, and the store only ever shows complete saves. Rank 0 mirrors; every rank
reads the staging directory (shared by the ranks of a host, as a local directory is). A
failed upload is raised on every rank at the next step: on several ranks they agree on
it at each poll (one all-reduce of two numbers over the gloo group in host memory that
background saves agree over, `hookloop.runfile.background_save.agree_outcome`), and the
last uploads are waited for and agreed on at the training's end (its last epoch end),
while every rank is still there.
The details: docs/callbacks/checkpoint_remote.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hookloop import distributed
from hookloop.base.checks import check_number, check_path
from hookloop.errors import CheckpointError, ConfigurationError
from hookloop.runfile.background_save import agree_outcome, raise_agreed
from hookloop.runfile.remote_mirror import RemoteMirror, default_staging
from hookloop.runfile.remote_store import is_url

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["RemoteMixin", "UrlDispatch", "remote_variant"]

_REMOTE_ONLY = ("storage_options", "staging_dir", "lease_seconds")
_VARIANTS: dict[type, type] = {}


def remote_variant(cls: type, dirpath: Any = None, *args: Any, **options: Any) -> type:
    """The class a ``Checkpoint(dirpath, ...)`` call makes: ``cls`` for a local path, its
    remote subclass for a URL.

    Raises:
        ConfigurationError: an option only a URL takes, with a local path.
    """
    if not is_url(dirpath) or issubclass(cls, RemoteMixin):
        if given := [name for name in _REMOTE_ONLY if options.get(name) is not None]:
            if not issubclass(cls, RemoteMixin):
                raise ConfigurationError(
                    f"Checkpoint {given[0]} is for a dirpath that is a URL (s3://bucket/run, "
                    f"memory://run...); {dirpath!r} is a local path: drop {given[0]}.")
        return cls
    if cls not in _VARIANTS:
        _VARIANTS[cls] = type(f"Remote{cls.__name__}", (RemoteMixin, cls),
                              {"__module__": cls.__module__, "__doc__": cls.__doc__})
    return _VARIANTS[cls]


class UrlDispatch:
    """A base of `Checkpoint`: ``Checkpoint(url, ...)`` makes its `remote_variant`.

    Here, not in `Checkpoint` itself: a ``__new__`` there would hide ``__init__``'s
    signature from `inspect.signature` (help, the docs)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__new__(remote_variant(cls, *args, **kwargs))


class RemoteMixin:
    """What a `Checkpoint` of a URL adds: the mirror's start, polls and end.

    Args (beyond `Checkpoint`'s):
        storage_options: Passed to fsspec for the URL (``{"client_kwargs":
            {"endpoint_url": ...}}``, ``{"profile": ...}``); credentials come from the
            environment as the filesystem's package reads them.
        staging_dir: The local directory the saves are written to before their upload
            (default: one per URL under the system's temporary directory). It belongs to
            the run: at the first fit it is made to hold the store's saves and only them.
        lease_seconds: How long the run's lease lasts without renewal (60).
    """

    url: str
    _mirror: RemoteMirror
    _started: bool
    _writes: Any  # the Checkpoint's RotatingWrites: its agreement group
    resume: Any
    _training_ends: Any  # Checkpoint's: the fit's last epoch end, when its last save is made

    def __init__(self, dirpath: str, *args: Any, storage_options: dict[str, Any] | None = None,
                 staging_dir: str | os.PathLike[str] | None = None,
                 lease_seconds: float = 60.0, **options: Any) -> None:
        url = dirpath.rstrip("/")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigurationError(f"Checkpoint storage_options must be a dict of fsspec "
                                     f"options, got {type(storage_options).__name__}.")
        staging = default_staging(url) if staging_dir is None else check_path(
            "Checkpoint staging_dir", staging_dir)
        seconds = check_number("Checkpoint lease_seconds", lease_seconds)
        if seconds is None or seconds <= 0:
            raise ConfigurationError(f"Checkpoint lease_seconds must be > 0, got {seconds}.")
        resume = options.get("resume")
        if isinstance(resume, str) and is_url(resume):
            if not resume.startswith(url + "/"):
                raise ConfigurationError(
                    f"Checkpoint resume={resume!r} is not a save of {url}: resume from a save "
                    "of the run's own URL (or True for the newest).")
            options["resume"] = os.path.join(staging, resume[len(url) + 1:])
        super().__init__(staging, *args, **options)  # type: ignore[call-arg]
        self.url = url
        self._mirror = RemoteMirror(url, staging, storage_options, seconds)

    def __repr__(self) -> str:
        return f"Checkpoint({self.url!r}, staging_dir={self._mirror.staging!r})"

    def _start(self) -> tuple[str, str] | None:
        try:
            refused = self._mirror.start(replicate=not self._started,
                                         resume=self.resume is not False)
        except CheckpointError as error:
            return ("damaged", str(error))
        return None if refused is None else ("refused", refused)

    def setup(self, loop: Loop) -> None:
        """Take the URL's lease and fetch its saves (rank 0), then `Checkpoint.setup`."""
        if loop.fitting:
            outcome = distributed.broadcast_object(self._start() if distributed.is_main()
                                                   else None)
            if outcome is not None:
                raise (CheckpointError if outcome[0] == "damaged" else
                       ConfigurationError)(outcome[1])
        try:
            super().setup(loop)  # type: ignore[misc]
        except BaseException:
            self._mirror.release()
            raise

    def _poll(self, *, last: bool = False) -> None:
        """Start the uploads due (rank 0) and raise a failed one on every rank; ``last``
        (the training's end): wait for every upload first."""
        failure = None
        if distributed.is_main():
            failure = self._mirror.flush() if last else self._mirror.check()
        if not (distributed.is_initialized() and distributed.world_size() > 1):
            if failure is not None:
                raise failure
            return
        _, failed = agree_outcome(self._writes.agreement_group(), done=True,
                                  failed=failure is not None)
        if failed:
            raise_agreed(failure, f"the upload to {self.url}")

    def on_batch_end(self, loop: Loop) -> None:
        super().on_batch_end(loop)  # type: ignore[misc]
        self._poll()

    def on_validation_end(self, loop: Loop) -> None:
        super().on_validation_end(loop)  # type: ignore[misc]
        self._poll()

    def on_epoch_end(self, loop: Loop) -> None:
        super().on_epoch_end(loop)  # type: ignore[misc]
        self._poll(last=self._training_ends(loop))

    def on_fit_end(self, loop: Loop) -> None:
        """`Checkpoint.on_fit_end`, then the last uploads (waited for) and the lease back."""
        try:
            super().on_fit_end(loop)  # type: ignore[misc]
        finally:
            if distributed.is_main():
                self._mirror.close()

    def on_exception(self, loop: Loop, exc: BaseException) -> None:
        try:
            super().on_exception(loop, exc)  # type: ignore[misc]
        finally:
            if distributed.is_main():
                self._mirror.close(raising=False)
