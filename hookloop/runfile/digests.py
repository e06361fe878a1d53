"""Digests taken as the bytes pass, never in a second pass over a file.

A save of a directory of shards records each file's size and content digest
(`hookloop.runfile.integrity`), and a remote save each object's
(`hookloop.runfile.remote_store`); every record names its algorithm (`ALGORITHM` for new
saves). The digest guards against damage (flipped bits, a truncated or swapped file), not
against an adversary who can write the checkpoint: XXH3-128 (the ``xxhash`` package) does
that at about 20 GB/s on this project's machine, where SHA-256 ran at about 1.2 GB/s and
cost as much as DCP's whole write (docs/performance.md). A record that names no algorithm
was written by hookloop 0.1 and is read as SHA-256 (`LEGACY`).

`recording_file_system` is the file system DCP's writer writes through: each stream it
opens for writing hashes what is written into it
(`HashingWriter`), and the record is complete when the stream is closed, so nothing reads
a shard back after DCP wrote it. A large write is hashed by a helper thread while the
calling thread writes it (the hash and the ``write`` call both release the GIL), where
the process has cores to spare; the write returns only once both are done, so no buffer is
used after its owner let it go.

At the load, `digests_of` hashes a directory's files in a thread beside the read that
needs them, each file once.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import xxhash

from hookloop.errors import CheckpointError

__all__ = ["ALGORITHM", "LEGACY", "HashingWriter", "check_algorithm", "digests_of",
           "file_digest", "new_digest", "recording_file_system"]

#: The content digest new saves record (its name is written beside each digest).
ALGORITHM = "xxh3_128"
#: The algorithm of a record that names none: hookloop 0.1 wrote SHA-256 only.
LEGACY = "sha256"
_ALGORITHMS: dict[str, Callable[[], Any]] = {ALGORITHM: xxhash.xxh3_128, LEGACY: hashlib.sha256}


def check_algorithm(name: Any, where: str) -> str:
    """``name`` when it is a digest algorithm hookloop reads, else a `CheckpointError`
    naming it and ``where`` (the file or object whose record names it).

    Example:
        >>> check_algorithm("xxh3_128", "x.dcp/hookloop.pt")
        'xxh3_128'
    """
    if isinstance(name, str) and name in _ALGORITHMS:
        return name
    raise CheckpointError(
        f"{where}: records its digests with the algorithm {name!r}, which this hookloop does "
        f"not know (it reads {' and '.join(sorted(_ALGORITHMS))}). It was written by a newer "
        "hookloop, or edited: upgrade hookloop to read it, or resume from another checkpoint.")


def new_digest(algorithm: str = ALGORITHM) -> Any:
    """A fresh hash object of ``algorithm`` (``update``, ``hexdigest``).

    Example:
        >>> new_digest("sha256").hexdigest()[:8], new_digest().hexdigest()[:8]
        ('e3b0c442', '99aa06d3')
    """
    return _ALGORITHMS[algorithm]()

#: Writes at least this large are hashed beside the write (where the process has a core to
#: spare), smaller ones inline.
_BESIDE = 1 << 20
#: Hashing beside the write needs a core of its own: measured on 2 shared cores, the
#: helper thread made a 0.27 GB save slower (0.84 s) than hashing inline (0.60 s).
_SPARE_CORES = 4


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
_CHUNK = 1 << 22


class HashingWriter:
    """Passes every write to ``stream`` and hashes it (`ALGORITHM`) on the way.

    Example:
        >>> import io
        >>> out = HashingWriter(io.BytesIO())
        >>> out.write(b"abc")
        3
        >>> out.size, out.hexdigest() == xxhash.xxh3_128(b"abc").hexdigest()
        (3, True)
    """

    def __init__(self, stream: Any, pool: ThreadPoolExecutor | None = None) -> None:
        self._stream = stream
        self._digest = new_digest()
        self._pool = pool
        #: How many bytes were written.
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._pool is not None and view.nbytes >= _BESIDE:
            hashed: Future[None] = self._pool.submit(self._digest.update, view)
            try:
                written = self._stream.write(view)
            finally:
                hashed.result()  # the caller's buffer is not touched after we return
        else:
            self._digest.update(view)
            written = self._stream.write(view)
        self.size += view.nbytes
        return view.nbytes if written is None else written

    def hexdigest(self) -> str:
        """The digest (`ALGORITHM`) of everything written so far, in hex."""
        return self._digest.hexdigest()

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close: the stream's
        return getattr(self._stream, name)


_RECORDING: list[type] = []


def recording_file_system() -> Any:
    """A new `RecordingFileSystem` (its class is made at the first call: DCP is imported only
    by a run that writes shards)."""
    if not _RECORDING:
        from torch.distributed.checkpoint.filesystem import FileSystem

        class RecordingFileSystem(FileSystem):  # type: ignore[misc]
            """DCP's local file system, recording ``{name: (size, digest)}`` of each file
            written through it, under its final name (DCP renames ``.metadata.tmp``)."""

            def __init__(self) -> None:
                super().__init__()
                self.record: dict[str, tuple[int, str]] = {}
                self._lock = threading.Lock()
                self._pool: ThreadPoolExecutor | None = None

            @contextmanager
            def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
                with super().create_stream(path, mode) as stream:
                    if "w" not in mode:
                        yield stream
                        return
                    with self._lock:
                        if self._pool is None and _cores() >= _SPARE_CORES:
                            self._pool = ThreadPoolExecutor(1, "hookloop-digest")
                    hashing = HashingWriter(stream, self._pool)
                    yield hashing
                with self._lock:
                    self.record[os.path.basename(os.fspath(path))] = (
                        hashing.size, hashing.hexdigest())

            def rename(self, path: Any, new_path: Any) -> None:
                super().rename(path, new_path)
                with self._lock:
                    entry = self.record.pop(os.path.basename(os.fspath(path)), None)
                    if entry is not None:
                        self.record[os.path.basename(os.fspath(new_path))] = entry

            def close(self) -> None:
                """Stop the helper thread."""
                if self._pool is not None:
                    self._pool.shutdown(wait=True)

        _RECORDING.append(RecordingFileSystem)
    return _RECORDING[0]()


def file_digest(path: str, algorithm: str = ALGORITHM) -> str:
    """The digest (``algorithm``) of the file ``path``, in hex, read without following a
    link: the one place a file's digest is computed.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "x")
        >>> _ = open(path, "wb").write(b"abc")
        >>> file_digest(path, "sha256")[:16]
        'ba7816bf8f01cfea'
    """
    digest = new_digest(algorithm)
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with open(descriptor, "rb", buffering=0) as handle:
        if os.name == "posix" and os.fstat(descriptor).st_size >= _CHUNK:
            # Hashed where the page cache holds it, without a copy into a buffer: half the
            # time of reading it (the same exposure as torch.load(mmap=True) of a file: a
            # file cut short by another process while it is hashed ends the process).
            with mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ) as pages:
                digest.update(pages)
            return digest.hexdigest()
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while read := handle.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def digests_of(paths: list[str], digest: Callable[[str], str | None]
               ) -> Callable[[], dict[str, str | None]]:
    """Start hashing ``paths`` (``digest(path)`` each, None where it cannot be read) in a
    thread; the returned function waits for it and gives ``{path: digest}``.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "x")
        >>> _ = open(path, "wb").write(b"abc")
        >>> digests_of([path], file_digest)()[path] == file_digest(path)
        True
    """
    found: dict[str, str | None] = {}
    failure: list[BaseException] = []

    def run() -> None:
        try:
            for path in paths:
                found[path] = digest(path)
        except BaseException as error:  # raised in the waiting thread
            failure.append(error)

    thread = threading.Thread(target=run, name="hookloop-verify", daemon=True)
    thread.start()

    def done() -> dict[str, str | None]:
        thread.join()
        if failure:
            raise failure[0]
        return found

    return done
