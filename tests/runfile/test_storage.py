"""Checkpoint files (hookloop/runfile/storage.py): writes that fail, damaged or wrong files, links,
directories that cannot be used, and load_checkpoint.

Faults are simulated (monkeypatched writes, a path that is a file, a failing probe), so the
tests run unprivileged; the oracle for what was written is a plain ``torch.load``.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hookloop import CheckpointError, ConfigurationError, Loop, load_checkpoint
from hookloop.callbacks import Checkpoint
from hookloop.errors import CheckpointWriteError
from hookloop.runfile import format as run_file, storage

from builders import make_loop as build_loop
from builders import regression_batches, shuffled_run, two_layers


def make_loop(directory: Path, **checkpoint: Any) -> Loop:
    return build_loop([Checkpoint(directory, **checkpoint)],
                      model=lambda: two_layers(3, 4, 1, nn.BatchNorm1d(4)),
                      train=lambda: regression_batches(3))


def payload() -> dict[str, Any]:
    return {"hookloop": {"format": 1, "kind": "best"}, "model": {"w": torch.arange(4.0)}}


def listing(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


class FailingFile(io.FileIO):
    """A file whose writes fail once ``limit`` bytes are written, like a disk that fills up."""

    limit = 0
    code = errno.ENOSPC

    def write(self, data: Any) -> int:
        size = len(memoryview(data))
        if self.tell() + size > self.limit:
            raise OSError(self.code, os.strerror(self.code))
        return super().write(data)


def fail_writes(monkeypatch: pytest.MonkeyPatch, after: int, code: int = errno.ENOSPC) -> None:
    FailingFile.limit, FailingFile.code = after, code
    real_fdopen = os.fdopen

    def fdopen(descriptor: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode:
            return io.BufferedWriter(FailingFile(descriptor, "wb"))
        return real_fdopen(descriptor, mode, *args, **kwargs)

    monkeypatch.setattr(storage.os, "fdopen", fdopen)


# --------------------------------------------------------------------------- writes
@pytest.mark.parametrize("after", [0, 700, 5000])
def test_a_full_disk_is_a_checkpoint_error_naming_file_and_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    target = tmp_path / "best.pt"
    storage.write_atomic(payload(), str(target))
    before = target.read_bytes()
    fail_writes(monkeypatch, after)
    big = {"hookloop": {"format": 1, "kind": "best"}, "model": {"w": torch.randn(4000)}}
    with pytest.raises(CheckpointError) as caught:
        storage.write_atomic(big, str(target))
    message = str(caught.value)
    assert str(target) in message and "no space left on the device" in message
    assert "inline_container" not in message
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    assert listing(tmp_path) == ["best.pt"]  # no temporary file left
    assert target.read_bytes() == before  # the earlier file intact


def test_failing_fsync_and_rename_are_checkpoint_errors(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "x.pt"

    def failing_fsync(descriptor: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(storage.os, "fsync", failing_fsync)
        with pytest.raises(CheckpointWriteError, match=r"fsync.*input/output error"):
            storage.write_atomic(payload(), str(target))
    assert listing(tmp_path) == []

    def failing_replace(source: str, destination: str) -> None:
        raise OSError(errno.EACCES, "Permission denied")

    with monkeypatch.context() as patch:
        patch.setattr(storage.os, "replace", failing_replace)
        with pytest.raises(CheckpointWriteError, match="permission denied"):
            storage.write_atomic(payload(), str(target))
    assert listing(tmp_path) == []


def test_a_deleted_directory_names_the_target_not_a_temp_file(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    with pytest.raises(CheckpointError) as caught:
        storage.write_atomic(payload(), str(gone / "epoch=0000-step=00000001.pt"))
    message = str(caught.value)
    assert str(gone / "epoch=0000-step=00000001.pt") in message
    assert "no longer exists" in message and ".part" not in message.split(":")[0]


def test_other_exceptions_propagate_unchanged_and_leave_no_temp(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    def interrupted(obj: object, handle: Any) -> None:
        handle.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(storage.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        storage.write_atomic(payload(), str(tmp_path / "x.pt"))
    assert listing(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_get_the_permissions_of_a_plain_torch_save(tmp_path: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        storage.write_atomic(payload(), str(tmp_path / "hookloop.pt"))
        torch.save(payload(), tmp_path / "plain.pt")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "hookloop.pt").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.pt").stat().st_mode) == 0o666 & ~umask


def test_a_full_disk_during_training_keeps_the_earlier_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_loop(tmp_path).fit(1)
    [earlier] = listing(tmp_path)
    before = (tmp_path / earlier).read_bytes()
    fail_writes(monkeypatch, after=1000)
    loop = make_loop(tmp_path, resume=True)
    with pytest.raises(CheckpointError, match="no space left"):
        loop.fit(2)
    monkeypatch.undo()
    assert listing(tmp_path) == [earlier]
    assert (tmp_path / earlier).read_bytes() == before
    torch.load(tmp_path / earlier, weights_only=True)


# ---------------------------------------------------------------------- directories
def test_prepare_directory_refuses_a_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    with pytest.raises(ConfigurationError, match=r"ckpt is a file, not a directory"):
        storage.prepare_directory(path)


def test_prepare_directory_refuses_a_directory_it_cannot_create(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigurationError, match=r"cannot be created: a part of the path is a file"):
        storage.prepare_directory(tmp_path / "file" / "ckpt")


def test_prepare_directory_probes_a_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as patch:
        patch.setattr(storage.tempfile, "mkstemp", read_only)
        with pytest.raises(ConfigurationError, match="not writable.*read-only"):
            storage.prepare_directory(tmp_path / "a")
    fail_writes(monkeypatch, after=0)
    with pytest.raises(ConfigurationError, match="probe file failed: no space left"):
        storage.prepare_directory(tmp_path / "b")
    monkeypatch.undo()
    assert listing(tmp_path / "b") == []  # the probe is removed
    assert storage.prepare_directory(tmp_path / "c") == str(tmp_path / "c")
    assert listing(tmp_path / "c") == []


def test_checkpoint_directory_that_is_a_file_fails_before_the_first_batch(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.write_text("x")
    loop = make_loop(path)
    with pytest.raises(ConfigurationError, match="is a file"):
        loop.fit(1)
    assert loop.state.step == 0


def test_checkpoint_directory_probe_fails_before_the_first_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_writes(monkeypatch, after=0)
    loop = make_loop(tmp_path / "ckpt")
    with pytest.raises(ConfigurationError, match="not writable"):
        loop.fit(1)
    assert loop.state.step == 0


def test_resume_skips_symlinks_that_point_outside(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    make_loop(elsewhere).fit(2)
    directory = tmp_path / "ckpt"
    make_loop(directory).fit(1)
    [own] = listing(directory)
    # A link named like a newer checkpoint, pointing at another run's file.
    outside = elsewhere / listing(elsewhere)[-1]
    (directory / "epoch=0005-step=00000099.pt").symlink_to(outside)
    inside = directory / "epoch=0000-step=00000002.pt"
    inside.symlink_to(directory / own)
    names = ["epoch=0005-step=00000099.pt", own, "epoch=0000-step=00000002.pt"]
    with pytest.warns(RuntimeWarning, match="symbolic link.*outside"):
        found = storage.regular_checkpoint_files(directory, names)
    assert found == [str(directory / own), str(inside)]
    # Through Checkpoint(resume=True): the outside link is not what resumes.
    loop = make_loop(directory, resume=True)
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        loop.fit(2)
    assert loop.state.step == 6


# -------------------------------------------------------------------------- reading
def _record_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (offset of its data, size), from the archive's own headers."""
    offsets = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as handle:
        for info in archive.infolist():
            handle.seek(info.header_offset + 26)
            name_length, extra_length = (int.from_bytes(handle.read(2), "little")
                                         for _ in range(2))
            offsets[info.filename] = (info.header_offset + 30 + name_length + extra_length,
                                      info.file_size)
    return offsets


@pytest.mark.parametrize("position", range(20))
def test_a_flipped_byte_in_tensor_data_is_refused(tmp_path: Path, position: int) -> None:
    make_loop(tmp_path).fit(1)
    [name] = listing(tmp_path)
    path = tmp_path / name
    data_records = {record: place for record, place in _record_offsets(path).items()
                     if "/data/" in record and place[1] > 0}
    records = sorted(data_records)
    record = records[position % len(records)]
    start, size = data_records[record]
    offset = start + (position * 7919) % size
    content = bytearray(path.read_bytes())
    content[offset] ^= 0x10
    path.write_bytes(bytes(content))
    # The oracle: torch.load alone takes the damaged file without complaint.
    torch.load(path, weights_only=True)
    with pytest.raises(CheckpointError, match=rf"damaged.*CRC.*{record.split('/')[-1]}"):
        load_checkpoint(path, nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))


def test_compressed_records_are_refused_before_inflating(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    plain = tmp_path / "plain.pt"
    storage.write_atomic({"hookloop": {"format": 1, "kind": "best"},
                          "model": {"w": torch.zeros(1 << 18)}}, str(plain))
    packed = tmp_path / "packed.pt"
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(packed, "w") as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info), compress_type=zipfile.ZIP_DEFLATED)
    assert packed.stat().st_size < plain.stat().st_size // 50

    def no_inflating(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a compressed record was opened")

    monkeypatch.setattr(zipfile.ZipFile, "open", no_inflating)
    monkeypatch.setattr(torch, "load", no_inflating)
    with pytest.raises(CheckpointError, match=r"compressed \(deflate"):
        load_checkpoint(packed, nn.Linear(1, 1))


def _saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    make_loop(tmp_path).fit(1)
    [name] = listing(tmp_path)
    return tmp_path / name, torch.load(tmp_path / name, weights_only=True)


def _edit(content: dict[str, Any], field: str, value: Any) -> None:
    *parents, last = field.split(".", 1) if field.startswith("model.") else field.split(".")
    for part in parents:
        content = content[part]
    if value is KeyError:
        del content[last]
    else:
        content[last] = value


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("hookloop.format", 3, "newer hookloop"),
    ("hookloop.format", "1", "'hookloop.format' is str"),
    ("hookloop.format", 0, "unknown checkpoint format 0"),
    ("hookloop.kind", "other", "'hookloop.kind' is str"),
    ("optimizer", KeyError, "without its 'optimizer' field"),
    ("loop", KeyError, "without its 'loop' field"),
    ("loop.step", "3", "'loop.step' is str"),
    ("loop.epoch", KeyError, "'loop.epoch' is missing"),
    ("loop", [1, 2], "'loop' is list"),
    ("optimizer.param_groups", {"lr": 1}, "'optimizer.param_groups' is dict"),
    ("model.0.weight", [1.0], "'model.0.weight' is list"),
    ("callbacks", [1], "'callbacks' is list"),
    ("ranks", {"a": 1}, "'ranks' is dict"),
    ("loop.history", {"a": 1}, "'loop.history' is dict"),
])
def test_a_wrong_payload_names_the_file_and_field(tmp_path: Path, field: str, value: Any,
                                                  expected: str) -> None:
    path, content = _saved(tmp_path)
    _edit(content, field, value)
    torch.save(content, path)
    with pytest.raises(CheckpointError, match=expected) as caught:
        make_loop(tmp_path, resume=str(path)).fit(2)
    assert str(path) in str(caught.value)
    with pytest.raises(CheckpointError, match=expected):
        run_file.read_payload(path, "cpu")


# ------------------------------------------------------------- more damaged files


@pytest.mark.parametrize("offset", [4, 16])  # disk number / total number of disks
def test_a_flipped_byte_in_the_zip64_locator_is_a_checkpoint_error(tmp_path: Path,
                                                                   offset: int) -> None:
    """One damaged byte in the zip64 end-of-central-directory locator is a CheckpointError,
    not a raw zipfile.BadZipFile."""
    path = tmp_path / "best.pt"
    torch.save({"hookloop": {"format": 2, "kind": "best"},
                "model": {"weight": torch.ones(1, 3), "bias": torch.ones(1)}}, path)
    raw = bytearray(path.read_bytes())
    locator = raw.rfind(b"PK\x06\x07")
    assert locator > 0
    raw[locator + offset] ^= 0x02  # disk 2 / 3 disks
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):  # oracle: read_payload's contract
        load_checkpoint(path, nn.Linear(3, 1))


@pytest.mark.parametrize("where,value", [
    (("callbacks", "EarlyStopping"), 5),
    (("callbacks", "EarlyStopping"), {"best": "x"}),
    (("ranks", 0, "rng", "torch"), "abc"),
])
def test_a_wrong_field_type_is_a_checkpoint_error_naming_the_file(
        tmp_path: Path, where: tuple, value: object) -> None:
    """A field of the wrong type inside a well-formed payload (a callback's state, a rank's
    RNG state) is a CheckpointError naming the file, not a raw error without it."""
    from hookloop.callbacks import EarlyStopping

    def make(directory: Path, resume: object) -> Loop:
        return build_loop([EarlyStopping("val_loss"), Checkpoint(directory, resume=resume)],
                          train=regression_batches(2, seed=1), val=lambda train: train)

    make(tmp_path / "a", False).fit(1)
    (good,) = (tmp_path / "a").iterdir()
    payload = torch.load(good, weights_only=True)
    target = payload
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    bad = tmp_path / "bad.pt"
    torch.save(payload, bad)
    with pytest.raises(CheckpointError, match="bad.pt"):
        make(tmp_path / "b", str(bad)).fit(2)


# ------------------------------------------------------------------- links, loading


def test_a_full_disk_while_linking_best_pt_is_a_checkpoint_write_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """best.pt under save_top_k > 1 is a link to a scored file (a copy where links fail): a
    failure there is a CheckpointWriteError naming best.pt, and leaves no temporary file."""
    import builtins

    def no_link(source, target):
        raise OSError(errno.EXDEV, "Invalid cross-device link")  # no hard links: copy

    class FullDisk:
        def __init__(self, path):
            self.path = path
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return False

    def fake_open(path, mode="r", *args, **kwargs):
        if "w" in mode and storage.is_temporary(os.path.basename(str(path))):
            builtins.open(path, mode, *args, **kwargs).close()  # the temp file exists
            return FullDisk(path)
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(storage.os, "link", no_link)
    monkeypatch.setattr(storage, "open", fake_open, raising=False)
    loop = build_loop([Checkpoint(tmp_path, monitor="val_loss", save_top_k=2)],
                      train=regression_batches(4, seed=1), val=lambda train: train)
    with pytest.raises(CheckpointError) as caught:  # storage.py's contract
        loop.fit(1)
    assert "best.pt" in str(caught.value) and "disk is full" in str(caught.value)
    assert not [name for name in os.listdir(tmp_path) if storage.is_temporary(name)]


def test_load_checkpoint_into_a_compiled_model(tmp_path: Path) -> None:
    model, loop = shuffled_run([Checkpoint(tmp_path)])
    loop.fit(1)
    torch.manual_seed(5)
    fresh = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
    compiled = torch.compile(fresh)  # a wrapper with _orig_mod: nothing is compiled until called
    load_checkpoint(tmp_path / "epoch=0000-step=00000012.pt", compiled)
    for ours, theirs in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(ours, theirs)
