"""hookloop.runfile.digests: a directory of shards is digested as DCP writes it, in one pass
(no file of it is read back by the save), and the digests recorded are those of the bytes
on disk (the oracle: xxhash over each file, read back here)."""

from __future__ import annotations

import builtins
import io
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from hookloop.runfile import integrity, shard_files
from hookloop.runfile.checkpoint_files import CheckpointFiles, file_meta
from hookloop.runfile.digests import HashingWriter
from hookloop.runfile.format import META, SHARDS, read_payload
from hookloop.runfile.shard_files import PLAIN_FILE


def test_a_sharded_save_reads_none_of_its_files_back_and_records_their_real_digests(
        tmp_path: Path, monkeypatch: Any) -> None:
    state = {f"w{index}": torch.randn(300_000) for index in range(3)}  # > 1 MB writes
    reads: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def watched_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode and "+" not in mode and ".tmp-" in str(file):
            reads.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    def watched_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR) == 0 and ".tmp-" in str(path) \
                and not os.path.isdir(path):  # a directory's fsync reads no shard
            reads.append(str(path))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", watched_open)
    monkeypatch.setattr(os, "open", watched_os_open)
    files = CheckpointFiles(str(tmp_path))
    path = files.write({"hookloop": file_meta("best"), "model": state}, "a.dcp", shards=True)
    monkeypatch.undo()
    assert reads == []  # the old save read every shard back to digest it
    record = read_payload(os.path.join(str(path), PLAIN_FILE), "cpu")[META][integrity.FILES_KEY]
    on_disk = sorted(name for name in os.listdir(str(path)) if name != PLAIN_FILE)
    assert sorted(record) == on_disk and ".metadata" in record
    for name in on_disk:
        data = (Path(str(path)) / name).read_bytes()
        assert record[name] == {"bytes": len(data), "algorithm": "xxh3_128",
                                "digest": xxhash.xxh3_128(data).hexdigest()}
    targets = {"model": {key: torch.empty_like(value) for key, value in state.items()}}
    shard_files.read_directory(str(path), "cpu")[SHARDS].read_into(targets)
    assert all(torch.equal(targets["model"][key], state[key]) for key in state)


def test_the_hashing_writer_hashes_large_and_small_writes_in_order() -> None:
    from concurrent.futures import ThreadPoolExecutor

    chunks = [b"x" * 10, os.urandom(3 << 20), b"yz", bytearray(os.urandom(1 << 20))]
    sink = io.BytesIO()
    with ThreadPoolExecutor(1) as pool:
        writer = HashingWriter(sink, pool)
        for chunk in chunks:
            assert writer.write(chunk) == len(chunk)
    joined = b"".join(bytes(chunk) for chunk in chunks)
    assert sink.getvalue() == joined and writer.size == len(joined)
    assert writer.hexdigest() == xxhash.xxh3_128(joined).hexdigest()
    assert writer.tell() == len(joined)  # the rest is the stream's


def _bytes_read() -> int:
    with open("/proc/self/io", encoding="ascii") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io") or os.name != "posix",
                    reason="reads counted by Linux's /proc/self/io")
def test_a_single_file_is_verified_and_loaded_without_a_second_pass(tmp_path: Path) -> None:
    """Every CRC is checked over the mapped file and torch.load maps the same pages: the
    process reads (read calls) a small part of the file, where the old path read it twice
    (the CRC pass through zipfile, then torch.load). The tensors are the saved ones, and
    writing into them leaves the file as it was (the mapping is private)."""
    state = {f"w{index}": torch.randn(1 << 20) for index in range(4)}  # 16 MB
    path = str(tmp_path / "a.pt")
    CheckpointFiles(str(tmp_path)).write({"hookloop": file_meta("best"), "model": state},
                                         "a.pt")
    size = os.path.getsize(path)
    before = _bytes_read()
    payload = read_payload(path, "cpu")
    read = _bytes_read() - before
    assert read < size // 4, (read, size)  # the old path read 2 x size
    assert all(torch.equal(payload["model"][key], state[key]) for key in state)
    payload["model"]["w0"].add_(1.0)
    again = torch.load(path, weights_only=True)
    assert torch.equal(again["model"]["w0"], state["w0"])


@pytest.mark.parametrize("spare", [False, True], ids=["inline", "beside"])
def test_both_ways_of_hashing_record_the_digests_of_the_bytes_on_disk(
        tmp_path: Path, monkeypatch: Any, spare: bool) -> None:
    """Hashed inline (2 cores) or in the helper thread beside each large write (cores to
    spare): the same digests, those of the files read back here."""
    from hookloop.runfile import digests

    monkeypatch.setattr(digests, "_SPARE_CORES", 1 if spare else 1 << 20)
    state = {f"w{index}": torch.randn(400_000) for index in range(3)}
    files = CheckpointFiles(str(tmp_path))
    path = files.write({"hookloop": file_meta("best"), "model": state}, "a.dcp", shards=True)
    record = read_payload(os.path.join(str(path), PLAIN_FILE), "cpu")[META][integrity.FILES_KEY]
    for name, entry in record.items():
        data = (Path(str(path)) / name).read_bytes()
        assert entry == {"bytes": len(data), "algorithm": "xxh3_128",
                         "digest": xxhash.xxh3_128(data).hexdigest()}
    assert not any(thread.name.startswith("hookloop-digest") and thread.is_alive()
                   for thread in threading.enumerate())  # the helper stopped with the save
