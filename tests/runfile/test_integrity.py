"""hookloop.runfile.integrity: every storage path (one file, a directory of shards, async, rotating,
top k, best, rollback) refuses a damaged, foreign or hostile file by name before anything
of it is read, and no code from a checkpoint runs.

The directories of shards are real ones: FSDP(state_dict="sharded") in a process group of
one, as torchrun would give it (two ranks: tests/distributed/test_checkpoint_integrity.py).
Each case copies a run's checkpoint, damages it, and reads it back through the public API
(``hookloop.load_checkpoint``, ``Checkpoint(resume=True)``, ``Checkpoint(resume=path)``).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil
import socket
import struct
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import xxhash
from builders import regression_dataset
from conftest import ROOT
from torch import nn
from torch.utils.data import DataLoader

from hookloop import CheckpointError, Loop
import hookloop
from hookloop.callbacks import FSDP, Checkpoint
from hookloop.runfile.integrity import FILES_KEY, SAVE_ID_KEY, file_digest, read_metadata

ROTATING = ("epoch=0000-step=00000006", "epoch=0001-step=00000012")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def _loop(seed: int, callbacks: list[Any]) -> Loop:
    model = _model(seed)
    data = DataLoader(regression_dataset(24, seed=1), batch_size=4)
    return Loop(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, val_data=data,
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=callbacks)


def _checkpoints(directory: Path) -> list[Checkpoint]:
    return [Checkpoint(directory / "kept", monitor="val_loss", save_top_k=2, keep_last=2),
            Checkpoint(directory / "async", keep_last=2, async_save=True, name="async")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Runs of 2 epochs (6 steps each) writing every kind: rotating, best, top-2 and async
    checkpoints; as one file each (no FSDP), and as directories of shards (FSDP sharded,
    one process), twice, the second run from other initial weights (the same shapes)."""
    root = tmp_path_factory.mktemp("integrity")
    _loop(3, _checkpoints(root / "files")).fit(2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    saved = {name: os.environ.get(name) for name in
             ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        for seed, name in ((3, "shards"), (4, "other")):
            _loop(seed, [FSDP(state_dict="sharded"), *_checkpoints(root / name)]).fit(2)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if dist.is_initialized():
            dist.destroy_process_group()
    yield {"files": root / "files", "shards": root / "shards", "other": root / "other"}


def test_each_run_wrote_every_kind(runs: dict[str, Path]) -> None:
    for kind, suffix in (("files", ".pt"), ("shards", ".dcp")):
        kept = sorted(path.name for path in (runs[kind] / "kept").iterdir()
                      if not path.name.startswith("."))
        assert [name for name in kept if name.startswith("epoch=")] == [
            f"{name}{suffix}" for name in ROTATING]
        assert f"best{suffix}" in kept
        assert sum(name.startswith("best-val_loss=") for name in kept) == 2
        assert sorted(path.name for path in (runs[kind] / "async").iterdir()
                      if not path.name.startswith(".")) == [
            f"async-{name}{suffix}" for name in ROTATING]


def _copy(runs: dict[str, Path], tmp_path: Path, kind: str, folder: str = "kept") -> Path:
    target = tmp_path / folder
    shutil.copytree(runs[kind] / folder, target,
                    ignore=shutil.ignore_patterns(".hookloop.lock"))
    return target


def _shard(directory: Path) -> Path:
    return directory / "__0_0.distcp"


def _flip_a_tensor_bit(path: Path) -> None:
    """One bit in the middle of the stored bytes of a weight: of the largest tensor of a
    ``.pt`` file, or of ``model.0.weight`` in a shard (its byte range from DCP's metadata;
    each tensor there is a torch.save archive of its own)."""
    data = bytearray(path.read_bytes())
    start, end = 0, len(data)
    if path.suffix == ".distcp":
        entries = read_metadata(str(path.parent)).storage_data
        info = next(info for index, info in entries.items() if index.fqn == "model.0.weight")
        start, end = info.offset, info.offset + info.length
    blob = bytes(data[start:end])
    record = max((item for item in zipfile.ZipFile(io.BytesIO(blob)).infolist()
                  if "/data/" in item.filename), key=lambda item: item.file_size)
    name_length, extra_length = struct.unpack("<HH", blob[record.header_offset + 26:
                                                          record.header_offset + 30])
    data[start + record.header_offset + 30 + name_length + extra_length
         + record.file_size // 2] ^= 0x04
    path.write_bytes(bytes(data))


class _Evil:
    """Unpickled, it would create the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _hostile_metadata(directory: Path, marker: Path) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))


def _rerecord(directory: Path) -> None:
    """Rewrite hookloop.pt's record to the files as they are now (an attacker's consistent
    directory): only the restricted unpickler then stands between a file and its code."""
    plain = directory / "hookloop.pt"
    payload = torch.load(plain, weights_only=True)
    for name, entry in payload["hookloop"][FILES_KEY].items():
        entry.update(bytes=os.path.getsize(directory / name), digest=file_digest(
            str(directory / name)))
    torch.save(payload, plain)


# What each damage does to a copied directory of shards, and what the error must name.
def _foreign_shard(directory: Path, other: Path) -> str:
    shutil.copyfile(_shard(other), _shard(directory))
    return str(_shard(directory))


def _foreign_plain(directory: Path, other: Path) -> str:
    shutil.copyfile(other / "hookloop.pt", directory / "hookloop.pt")
    return str(directory / "hookloop.pt")


def _flipped(directory: Path, other: Path) -> str:
    _flip_a_tensor_bit(_shard(directory))
    return str(_shard(directory))


def _truncated_shard(directory: Path, other: Path) -> str:
    data = _shard(directory).read_bytes()
    _shard(directory).write_bytes(data[: len(data) - 100])
    return str(_shard(directory))


def _missing_shard(directory: Path, other: Path) -> str:
    _shard(directory).unlink()
    return str(_shard(directory))


def _truncated_metadata(directory: Path, other: Path) -> str:
    data = (directory / ".metadata").read_bytes()
    (directory / ".metadata").write_bytes(data[: len(data) // 2])
    return str(directory / ".metadata")


def _no_metadata(directory: Path, other: Path) -> str:
    (directory / ".metadata").unlink()
    return str(directory)


DAMAGES: dict[str, tuple[Callable[[Path, Path], str], str]] = {
    "foreign shard": (_foreign_shard, "other bytes than the save wrote"),
    "foreign hookloop.pt": (_foreign_plain, "belongs to another save"),
    "flipped bit": (_flipped, "other bytes than the save wrote"),
    "truncated shard": (_truncated_shard, "(truncated, or another file)"),
    "missing shard": (_missing_shard, "is missing"),
    "truncated metadata": (_truncated_metadata, "(truncated, or another file)"),
    "no metadata": (_no_metadata, "lacks .metadata"),
}


def test_the_flip_lands_in_tensor_bytes_and_torch_alone_loads_it_silently(
        runs: dict[str, Path], tmp_path: Path) -> None:
    """The oracle for the flipped bit: DCP's own reader (no hookloop check) loads the
    damaged shard without a word, into weights that differ from the saved ones."""
    import torch.distributed.checkpoint as dcp

    directory = _copy(runs, tmp_path, "shards") / f"{ROTATING[1]}.dcp"
    intact = {"model": _model(0).state_dict()}
    dcp.load(intact, checkpoint_id=str(directory))
    _flip_a_tensor_bit(_shard(directory))
    damaged = {"model": _model(0).state_dict()}
    dcp.load(damaged, checkpoint_id=str(directory))
    assert any(not torch.equal(damaged["model"][name], intact["model"][name])
               for name in intact["model"])


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_or_foreign_file_of_a_directory_is_refused_by_name(
        runs: dict[str, Path], tmp_path: Path, damage: str) -> None:
    kept = _copy(runs, tmp_path, "shards")
    directory = kept / f"{ROTATING[1]}.dcp"
    harm, says = DAMAGES[damage]
    named = harm(directory, runs["other"] / "kept" / f"{ROTATING[1]}.dcp")
    model = _model(9)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="never skips a damaged one") as raised:
        _loop(9, [Checkpoint(kept, monitor="val_loss", save_top_k=2, keep_last=2,
                             resume=True)]).fit(3)
    message = str(raised.value)
    assert named in message and says in message, message
    # The fix: the older checkpoint resuming would continue from, and the steps redone.
    assert f"{ROTATING[0]}.dcp, redoing steps 7 to 12" in message
    with pytest.raises(CheckpointError, match=says) as loaded:
        hookloop.load_checkpoint(directory, model)
    assert named in str(loaded.value)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


@pytest.mark.parametrize("consistent", [False, True], ids=["as-found", "records-rewritten"])
def test_a_hostile_metadata_runs_no_code_and_is_refused_by_name(
        runs: dict[str, Path], tmp_path: Path, consistent: bool) -> None:
    """Refused by its digest; and, where an attacker rewrote hookloop.pt's record to match,
    by the unpickler that admits DCP's metadata classes only."""
    kept = _copy(runs, tmp_path, "shards")
    directory = kept / f"{ROTATING[1]}.dcp"
    marker = tmp_path / "pwned"
    _hostile_metadata(directory, marker)
    if consistent:
        _rerecord(directory)
    with pytest.raises(CheckpointError) as resumed:
        _loop(9, [Checkpoint(kept, monitor="val_loss", save_top_k=2, keep_last=2,
                             resume=True)]).fit(3)
    with pytest.raises(CheckpointError) as loaded:
        hookloop.load_checkpoint(directory, _model(9))
    with pytest.raises(CheckpointError) as read:
        read_metadata(str(directory))
    for error in (resumed.value, loaded.value, read.value):
        assert str(directory / ".metadata") in str(error), str(error)
    assert "open, which DCP's metadata never holds" in str(read.value), str(read.value)
    assert not marker.exists()  # the oracle: plain pickle would have created it
    pickle.loads((directory / ".metadata").read_bytes()).close()
    assert marker.exists()


def _setting(target: bytes, attribute: str) -> bytes:
    """A pickle that fills in ``target`` (pickle opcodes pushing one object) with
    ``{attribute: "poisoned"}`` as slot state (pickle's BUILD then calls ``setattr``)."""
    name = attribute.encode()
    return (b"\x80\x02" + target + b"N}X" + struct.pack("<I", len(name)) + name
            + b"X\x08\x00\x00\x00poisoneds\x86b.")


@pytest.mark.parametrize("target", [
    b"ctorch.distributed.checkpoint.metadata\nMetadata\n",  # an admitted class
    b"ctorch.serialization\n_get_layout\n",  # an admitted function (its layout cache)
    b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R",  # a member
], ids=["class", "function", "enum-member"])
def test_a_hostile_metadata_changes_no_admitted_class_or_function(
        tmp_path: Path, target: bytes) -> None:
    """The admitted names are safe to call, but pickle's BUILD would also set attributes on
    them (or on the shared enum member a call returns) for the whole process, refused file
    or not: it is refused by name before anything is set."""
    from torch.distributed.checkpoint import metadata
    from torch.serialization import _get_layout

    attribute = "_hookloop_poisoned"
    (tmp_path / ".metadata").write_bytes(_setting(target, attribute))
    with pytest.raises(CheckpointError) as read:
        read_metadata(str(tmp_path))
    assert str(tmp_path / ".metadata") in str(read.value), str(read.value)
    assert "sets the attributes" in str(read.value), str(read.value)
    touched = [metadata.Metadata, _get_layout, metadata._MEM_FORMAT_ENCODING(0)]
    assert not [item for item in touched if hasattr(item, attribute)]
    # The oracle: plain pickle sets it.
    pickle.loads((tmp_path / ".metadata").read_bytes())
    assert [item for item in touched if hasattr(item, attribute)]
    for item in touched:
        if attribute in vars(item):
            delattr(item, attribute)


@pytest.mark.parametrize("name", ["../other.dcp/__0_0.distcp", "/tmp/__0_0.distcp", ".."])
def test_a_metadata_naming_a_shard_outside_its_directory_is_refused(
        tmp_path: Path, name: str) -> None:
    """DCP opens each shard as directory / relative_path: a .metadata naming a file
    elsewhere would have it read past the digests, which cover the directory's files."""
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "one.dcp"
    with pytest.warns(UserWarning):  # DCP: no process group, one process
        dcp.save({"weight": torch.arange(4.0)}, checkpoint_id=str(directory))
    metadata = read_metadata(str(directory))  # as written: admitted
    assert {info.relative_path for info in metadata.storage_data.values()} == {"__0_0.distcp"}
    for info in metadata.storage_data.values():
        info.relative_path = name
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="is not a file of its own directory") as read:
        read_metadata(str(directory))
    assert str(directory / ".metadata") in str(read.value) and repr(name) in str(read.value)


@pytest.mark.parametrize("kind", ["files", "shards"])
@pytest.mark.parametrize("path", ["best", "top-k", "async", "rollback", "intact"])
def test_every_storage_path_refuses_a_flipped_bit_by_name(
        runs: dict[str, Path], tmp_path: Path, kind: str, path: str) -> None:
    """best, a top-k file, an async rotating file and a rollback's file (resume=path): one
    flipped bit of tensor data, refused naming the file; the intact ones load exactly."""
    suffix = ".pt" if kind == "files" else ".dcp"
    folder = "async" if path == "async" else "kept"
    kept = _copy(runs, tmp_path, kind, folder)
    names = sorted(os.listdir(kept))
    target = kept / {"best": f"best{suffix}", "async": f"async-{ROTATING[1]}{suffix}",
                     "rollback": f"{ROTATING[0]}{suffix}", "intact": f"{ROTATING[1]}{suffix}",
                     "top-k": next((name for name in names if name.startswith("best-")), "")}[path]
    model = _model(9)
    hookloop.load_checkpoint(target, model)
    expected = model.state_dict()
    if path == "intact":  # the control: the same reads of undamaged files succeed, exactly
        resumed = _loop(9, [Checkpoint(kept, monitor="val_loss", save_top_k=2, keep_last=2,
                                       resume=target)])
        resumed.fit(2)  # the run ended at this file: nothing trains
        assert all(torch.equal(value, expected[name])
                   for name, value in resumed.model.state_dict().items())
        return
    damaged = _shard(target) if kind == "shards" else target
    _flip_a_tensor_bit(damaged)
    with pytest.raises(CheckpointError) as raised:
        hookloop.load_checkpoint(target, _model(9))
    assert str(damaged) in str(raised.value), str(raised.value)
    if path in ("rollback", "async"):
        options: dict[str, Any] = ({"resume": target} if path == "rollback" else
                                   {"resume": True, "name": "async", "keep_last": 2})
        with pytest.raises(CheckpointError) as raised:
            _loop(9, [Checkpoint(kept, **options)]).fit(3)
        assert str(damaged) in str(raised.value), str(raised.value)


def test_a_hostile_single_file_runs_no_code_and_is_refused_by_name(
        runs: dict[str, Path], tmp_path: Path) -> None:
    kept = _copy(runs, tmp_path, "files")
    newest = kept / f"{ROTATING[1]}.pt"
    marker = tmp_path / "pwned"
    torch.save({"hookloop": _Evil(marker)}, newest)
    with pytest.raises(CheckpointError, match="never skips a damaged one") as raised:
        _loop(9, [Checkpoint(kept, monitor="val_loss", save_top_k=2, keep_last=2,
                             resume=True)]).fit(3)
    assert str(newest) in str(raised.value) and not marker.exists()


@pytest.mark.parametrize("kind", ["files", "shards"])
def test_one_policy_for_a_damaged_newest_checkpoint_file_or_directory(
        runs: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """A truncated newest file and a newest directory without hookloop.pt: both an error
    naming it, the older checkpoint resuming would take and the steps redone; once moved
    away as the message says, resume=True continues from the older one."""
    suffix = ".pt" if kind == "files" else ".dcp"
    kept = _copy(runs, tmp_path, kind)
    newest = kept / f"{ROTATING[1]}{suffix}"
    if kind == "files":
        newest.write_bytes(newest.read_bytes()[:-200])
    else:
        (newest / "hookloop.pt").unlink()
    with pytest.raises(CheckpointError) as raised:
        _loop(9, [Checkpoint(kept, monitor="val_loss", save_top_k=2, keep_last=2,
                             resume=True)]).fit(3)
    message = str(raised.value)
    assert str(newest) in message and "move it out of the directory" in message
    assert f"resume=True continues from {ROTATING[0]}{suffix}, redoing steps 7 to 12" in message
    shutil.move(str(newest), str(tmp_path / newest.name))
    resumed = _loop(9, [Checkpoint(kept, monitor="val_loss", save_top_k=2, keep_last=2,
                                   resume=True)])
    resumed.fit(1)  # the older file ended epoch 0: nothing left to train
    assert resumed.state.step == 6


def test_a_saved_directory_records_its_save_id_and_every_file_it_holds(
        runs: dict[str, Path]) -> None:
    directory = runs["shards"] / "kept" / f"{ROTATING[1]}.dcp"
    meta = torch.load(directory / "hookloop.pt", weights_only=True)["hookloop"]
    record = meta[FILES_KEY]
    assert sorted(record) == sorted(name for name in os.listdir(directory)
                                    if name != "hookloop.pt")
    for name, entry in record.items():
        assert entry == {"bytes": os.path.getsize(directory / name), "algorithm": "xxh3_128",
                         "digest": xxhash.xxh3_128((directory / name).read_bytes()).hexdigest()}
    assert read_metadata(str(directory)).storage_meta.save_id == meta[SAVE_ID_KEY]
    other = torch.load(runs["other"] / "kept" / f"{ROTATING[1]}.dcp" / "hookloop.pt",
                       weights_only=True)["hookloop"]
    assert other[SAVE_ID_KEY] != meta[SAVE_ID_KEY]


def _checkpoint_exception(failure: BaseException) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("write_data", {1: (failure, None)})


WRITE_FAILURES: dict[str, tuple[Callable[[], BaseException], Any]] = {
    "oserror": (lambda: OSError(28, "No space left on device"),
                "no space left on the device (the disk is full)"),
    "wrapped-enospc": (lambda: _checkpoint_exception(OSError(28, "full")),
                       "no space left on the device (the disk is full)"),
    "wrapped-runtime": (lambda: _checkpoint_exception(RuntimeError("a storage backend failed")),
                        "RuntimeError: a storage backend failed"),
    "wrapped-interrupt": (lambda: _checkpoint_exception(KeyboardInterrupt()), KeyboardInterrupt),
    "interrupt": (KeyboardInterrupt, KeyboardInterrupt),
    "exit": (lambda: SystemExit(3), SystemExit),
}


@pytest.mark.parametrize("case", list(WRITE_FAILURES))
def test_a_dcp_write_failure_is_a_named_write_error_and_ctrl_c_stays_ctrl_c(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """torch's CheckpointException derives from BaseException; it becomes
    CheckpointWriteError with the cause a rank's failure holds, while a KeyboardInterrupt or
    SystemExit (also one wrapped for a rank) is raised as it is: a stop, not a bad disk."""
    import torch.distributed.checkpoint as dcp

    from hookloop import CheckpointWriteError
    from hookloop.runfile.checkpoint_files import CheckpointFiles, file_meta

    failure, expected = WRITE_FAILURES[case]

    def fail(*args: Any, **kwargs: Any) -> None:
        raise failure()

    monkeypatch.setattr(dcp, "save", fail)
    files = CheckpointFiles(str(tmp_path))
    payload = {"hookloop": file_meta("best"), "model": {"w": torch.ones(2)}}
    if isinstance(expected, type):
        with pytest.raises(expected):
            files.write(payload, "best.dcp", shards=True)
    else:
        with pytest.raises(CheckpointWriteError, match="best.dcp") as caught:
            files.write(payload, "best.dcp", shards=True)
        assert expected in str(caught.value)
        assert caught.value.errno == (28 if "disk is full" in expected else None)
    assert os.listdir(tmp_path) == []  # no directory under the name, no temporary left


def test_a_dcp_read_failure_is_a_named_checkpoint_error(
        runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure inside DCP's read (here a shard vanishing after the check) is the
    directory's CheckpointError with its cause, not torch's raw CheckpointException."""
    import torch.distributed.checkpoint as dcp

    directory = _copy(runs, tmp_path, "shards") / f"{ROTATING[1]}.dcp"
    original = dcp.load

    def vanish_then_load(*args: Any, **kwargs: Any) -> Any:
        _shard(directory).unlink()
        return original(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", vanish_then_load)
    with pytest.raises(CheckpointError, match="a file of it is missing") as raised:
        hookloop.load_checkpoint(directory, _model(9))
    assert str(directory) in str(raised.value)
    assert "no such file" in str(raised.value).lower() or "errno 2" in str(raised.value)


def test_a_shards_non_tensor_entry_loads_only_as_weights_only_allows(tmp_path: Path) -> None:
    """DCP reads a shard's non-tensor entries with torch.load(weights_only=False); through
    hookloop an int comes back as it was and a pickle that would run code is refused."""
    from hookloop.runfile.checkpoint_files import CheckpointFiles, file_meta
    from hookloop.runfile.shard_files import Shards

    marker = tmp_path / "pwned"
    payload = {"hookloop": file_meta("resume"), "model": {"w": torch.ones(2)},
               "optimizer": {"state": {"w": {"n_iter": 7, "evil": _Evil(marker)}},
                             "param_groups": []}}
    path = CheckpointFiles(str(tmp_path)).write(payload, "a.dcp", shards=True)
    assert path is not None and not marker.exists()
    counted = {"optimizer": {"state": {"w": {"n_iter": 0}}}}
    Shards(path).read_into(counted)
    assert counted["optimizer"]["state"]["w"]["n_iter"] == 7
    with pytest.raises(CheckpointError, match="a.dcp"):
        Shards(path).read_into({"optimizer": {"state": {"w": {"evil": 0}}}})
    assert not marker.exists()
    import torch.distributed.checkpoint as dcp  # the oracle: torch's own reader runs it

    dcp.load({"optimizer": {"state": {"w": {"evil": 0}}}}, checkpoint_id=path)
    assert marker.exists()


def _zstd_bomb(inflated: int) -> bytes:
    """A Zstandard frame of RLE blocks (4 bytes each, 128 KiB inflated): ``inflated`` bytes
    from a few KB, as a crafted shard would hold (made by hand: no zstd module needed)."""
    block = 1 << 17
    count = inflated // block
    frame = b"\x28\xb5\x2f\xfd" + bytes([0x00, 0x70])  # magic; no checksum, 8 MiB window
    for index in range(count):
        last = 1 if index == count - 1 else 0
        header = last | (1 << 1) | (block << 3)  # block type 1: RLE of one byte
        frame += header.to_bytes(3, "little") + b"\x00"
    return frame


def test_a_metadata_asking_for_a_transform_is_refused_without_inflating_it(
        runs: dict[str, Path], tmp_path: Path) -> None:
    """Issue 33 item 3: DCP's ``transform_descriptors`` (its stream extensions) would have
    a ``stream.zstd`` entry inflated as it is read: a few KB toward gigabytes in memory
    (where zstandard or pyzstd is installed). hookloop never writes a transform: one is
    refused from the .metadata alone, with the directory's records made consistent (an
    attacker's rewrite), before any shard is opened; the peak memory stays small."""
    import tracemalloc

    kept = _copy(runs, tmp_path, "shards")
    directory = kept / f"{ROTATING[1]}.dcp"
    metadata = read_metadata(str(directory))
    bomb = _zstd_bomb(1 << 31)
    shard = _shard(directory)
    offset = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + bomb)
    info = next(info for index, info in metadata.storage_data.items()
                if index.fqn == "model.0.weight")
    info.offset, info.length = offset, len(bomb)
    info.transform_descriptors = ["stream.zstd/1"]
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    _rerecord(directory)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as loaded:
            hookloop.load_checkpoint(directory, _model(9))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(loaded.value)
    assert str(directory / ".metadata") in message and "stream.zstd/1" in message, message
    assert "never writes a transform" in message, message
    assert peak < 64 << 20, peak
    with pytest.raises(CheckpointError, match="never writes a transform"):
        _loop(9, [Checkpoint(kept, monitor="val_loss", save_top_k=2, keep_last=2,
                             resume=True)]).fit(3)


def _link_out(directory: Path, name: str, outside: Path) -> Path:
    """Move the file ``name`` of ``directory`` to ``outside`` and leave a link to it: the
    same bytes, recorded digests intact, but read from outside the run directory."""
    outside.mkdir(exist_ok=True)
    target = outside / name.lstrip(".")
    shutil.move(str(directory / name), str(target))
    (directory / name).symlink_to(target)
    return target


@pytest.mark.parametrize("name", ["__0_0.distcp", "hookloop.pt", ".metadata"])
def test_a_file_of_a_directory_linked_outside_is_treated_like_a_linked_rotating_file(
        runs: dict[str, Path], tmp_path: Path, name: str) -> None:
    """Issue 33 item 4: one rule for every entry. A rotating file linked outside the
    directory is skipped by resume=True with a warning; so is a directory of shards one of
    whose files is such a link (resume continues from the older checkpoint), and reading
    it by its path refuses it by name, the link and its target named."""
    kept = _copy(runs, tmp_path, "shards")
    newest = kept / f"{ROTATING[1]}.dcp"
    _link_out(newest, name, tmp_path / "outside")
    with pytest.raises(CheckpointError) as loaded:
        hookloop.load_checkpoint(newest, _model(9))
    assert str(newest / name) in str(loaded.value), str(loaded.value)
    assert "symbolic link" in str(loaded.value) and "outside" in str(loaded.value)
    resumed = _loop(9, [Checkpoint(kept, monitor="val_loss", save_top_k=2, keep_last=2,
                                   resume=True)])
    with pytest.warns(RuntimeWarning, match=f"skipping {newest / name}: it is a symbolic link"):
        resumed.fit(1)  # from the older file (end of epoch 0): nothing left to train
    assert resumed.state.step == 6


def test_a_refusal_says_nothing_of_a_foreign_target(runs: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """Item 4: a .metadata linked to another file (here a stand-in of /etc/passwd, and
    /proc/self/environ) is refused as a link, without its size or content in the message;
    a file that is no pickle at all gets a cause in words, not an opcode's number."""
    kept = _copy(runs, tmp_path, "shards")
    directory = kept / f"{ROTATING[1]}.dcp"
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n" * 37)
    for target in (secret, Path("/proc/self/environ")):
        (directory / ".metadata").unlink()
        (directory / ".metadata").symlink_to(target)
        with pytest.raises(CheckpointError) as loaded:
            hookloop.load_checkpoint(directory, _model(9))
        message = str(loaded.value)
        assert f"{directory / '.metadata'}: is a symbolic link to " in message, message
        assert "outside" in message and "refused: 79" not in message, message
        assert "bytes" not in message and str(secret.stat().st_size) not in message, message
    (directory / ".metadata").unlink()
    (directory / ".metadata").write_bytes(b"O=/bin/sh\x00HOME=/root")
    with pytest.raises(CheckpointError, match="byte 0x4f is no pickle opcode"):
        read_metadata(str(directory))



def test_the_digests_stop_damage_not_a_rewritten_record_as_the_docs_say(
        runs: dict[str, Path], tmp_path: Path) -> None:
    """Item 5: the record is unsigned. A foreign shard is refused by its digest; once an
    attacker rewrites hookloop.pt's record to it, the other run's weights load (and no
    code runs either way). docs/callbacks/checkpoint.md says exactly this."""
    kept = _copy(runs, tmp_path, "shards")
    directory = kept / f"{ROTATING[1]}.dcp"
    other = runs["other"] / "kept" / f"{ROTATING[1]}.dcp"
    shutil.copyfile(_shard(other), _shard(directory))
    with pytest.raises(CheckpointError, match="other bytes than the save wrote"):
        hookloop.load_checkpoint(directory, _model(9))
    shutil.copyfile(other / ".metadata", directory / ".metadata")
    payload = torch.load(directory / "hookloop.pt", weights_only=True)
    payload["hookloop"][SAVE_ID_KEY] = read_metadata(str(other)).storage_meta.save_id
    torch.save(payload, directory / "hookloop.pt")
    _rerecord(directory)
    swapped, expected = _model(9), _model(9)
    hookloop.load_checkpoint(directory, swapped)
    hookloop.load_checkpoint(other, expected)
    assert all(torch.equal(value, expected.state_dict()[name])
               for name, value in swapped.state_dict().items())
    page = (ROOT / "docs" / "callbacks" / "checkpoint.md").read_text()
    assert "What the digests guarantee, and what they do not." in page
    assert "rewrite that record to match other files, and then other weights" in page


def _as_hookloop_0_1(directory: Path) -> None:
    """Rewrite each file's record of ``directory`` as hookloop 0.1 wrote it: no algorithm
    named, the SHA-256 (hashlib's, of the bytes on disk) under the key ``sha256``."""
    plain = directory / "hookloop.pt"
    payload = torch.load(plain, weights_only=True)
    record = payload["hookloop"][FILES_KEY]
    for name in record:
        data = (directory / name).read_bytes()
        record[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    torch.save(payload, plain)


def test_a_directory_of_hookloop_0_1_sha256_records_resumes_exactly_and_refuses_damage(
        runs: dict[str, Path], tmp_path: Path) -> None:
    """Checkpoints written before the digest named its algorithm (SHA-256 records) verify
    and resume into the weights the same checkpoint gives with today's records; a flipped
    bit in one of them is still refused, naming the file and SHA-256."""
    old, today = _copy(runs, tmp_path / "old", "shards"), _copy(runs, tmp_path, "shards")
    for directory in old.glob("*.dcp"):
        _as_hookloop_0_1(directory)
    newest = old / f"{ROTATING[1]}.dcp"
    assert "sha256" in next(iter(torch.load(newest / "hookloop.pt", weights_only=True)[
        "hookloop"][FILES_KEY].values()))
    resumed, oracle = (_loop(9, [Checkpoint(folder, monitor="val_loss", save_top_k=2,
                                            keep_last=2, resume=True)]) for folder in (old, today))
    resumed.fit(3)
    oracle.fit(3)
    assert resumed.state.step == oracle.state.step == 18
    assert all(torch.equal(value, oracle.model.state_dict()[name])
               for name, value in resumed.model.state_dict().items())
    target = old / "copy.dcp"
    shutil.copytree(runs["shards"] / "kept" / f"{ROTATING[1]}.dcp", target)
    _as_hookloop_0_1(target)
    _flip_a_tensor_bit(_shard(target))
    with pytest.raises(CheckpointError, match="its sha256 digest differs") as raised:
        hookloop.load_checkpoint(target, _model(9))
    assert str(_shard(target)) in str(raised.value)


def test_a_damaged_file_under_an_xxh3_record_is_refused_naming_it_and_the_algorithm(
        runs: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(runs, tmp_path, "shards") / f"{ROTATING[1]}.dcp"
    entry = torch.load(directory / "hookloop.pt", weights_only=True)["hookloop"][FILES_KEY][
        _shard(directory).name]
    assert entry["algorithm"] == "xxh3_128"
    assert entry["digest"] == xxhash.xxh3_128(_shard(directory).read_bytes()).hexdigest()
    _flip_a_tensor_bit(_shard(directory))
    with pytest.raises(CheckpointError, match="its xxh3_128 digest differs") as raised:
        hookloop.load_checkpoint(directory, _model(9))
    assert str(_shard(directory)) in str(raised.value)


def test_a_record_naming_an_unknown_digest_algorithm_is_refused_by_name(
        runs: dict[str, Path], tmp_path: Path) -> None:
    directory = _copy(runs, tmp_path, "shards") / f"{ROTATING[1]}.dcp"
    payload = torch.load(directory / "hookloop.pt", weights_only=True)
    for entry in payload["hookloop"][FILES_KEY].values():
        entry["algorithm"] = "blake7"
    torch.save(payload, directory / "hookloop.pt")
    with pytest.raises(CheckpointError, match="'blake7', which this hookloop does not know"
                       ) as raised:
        hookloop.load_checkpoint(directory, _model(9))
    assert str(directory / "hookloop.pt") in str(raised.value)
    assert "upgrade hookloop" in str(raised.value)
