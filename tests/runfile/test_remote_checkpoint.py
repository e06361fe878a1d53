"""Checkpoints on an object store (issue 36 items 1-2): `Checkpoint(url)` saves through a
staging directory mirrored to the store, a manifest written last makes a save visible, the
bytes are verified when read back, and a lease holds the run. ``memory://`` for the quick
checks, moto's S3 server on localhost for the ones that prove the store's behaviour."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
import xxhash

from hookloop import Loop, load_checkpoint
from hookloop.callbacks import Checkpoint
from hookloop.errors import CheckpointError, ConfigurationError
from hookloop.runfile.remote_lease import RemoteLease
from hookloop.runfile.remote_store import MANIFEST_SUFFIX, RemoteStore, fetched

from s3_endpoint import s3_endpoint


@pytest.fixture(scope="module")
def s3() -> Iterator[dict]:
    with s3_endpoint() as options:
        yield options


def fit(url: str, tmp_path: Path, epochs: int, *, seed: int = 0, **options) -> Loop:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(3)]
    options.setdefault("staging_dir", str(tmp_path / f"staging-{uuid.uuid4().hex[:6]}"))
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=torch.nn.functional.mse_loss, device="cpu",
                callbacks=[Checkpoint(url, **options)])
    loop.fit(epochs)
    return loop


def memory_url() -> str:
    return f"memory://runs/{uuid.uuid4().hex}"


def test_a_url_run_lists_only_manifested_saves_prunes_them_and_loads(tmp_path: Path) -> None:
    url = memory_url()
    loop = fit(url, tmp_path, 3, keep_last=2, every_n_steps=1)
    store = RemoteStore(url)
    assert store.saves() == ["epoch=0002-step=00000008.pt", "epoch=0002-step=00000009.pt"]
    assert sorted(store.objects()) == sorted(
        name + suffix for name in store.saves() for suffix in ("", MANIFEST_SUFFIX))
    fresh = torch.nn.Linear(3, 1)
    load_checkpoint(f"{url}/epoch=0002-step=00000009.pt", fresh)
    assert torch.equal(fresh.weight, loop.model.weight)
    # A resume in another staging directory downloads the newest save and continues to
    # the weights of an uninterrupted run.
    resumed = fit(url, tmp_path, 5, keep_last=2, every_n_steps=1, resume=True)
    straight = fit(memory_url(), tmp_path, 5, keep_last=2, every_n_steps=1)
    assert torch.equal(resumed.model.weight, straight.model.weight)
    assert store.saves() == ["epoch=0004-step=00000014.pt", "epoch=0004-step=00000015.pt"]


def test_async_saves_are_mirrored_once_complete(tmp_path: Path) -> None:
    url = memory_url()
    loop = fit(url, tmp_path, 3, keep_last=1, async_save=True)
    assert RemoteStore(url).saves() == ["epoch=0002-step=00000009.pt"]
    fresh = torch.nn.Linear(3, 1)
    load_checkpoint(f"{url}/epoch=0002-step=00000009.pt", fresh)
    assert torch.equal(fresh.weight, loop.model.weight)


def test_a_partial_save_is_invisible_and_cleaned_at_the_next_start(tmp_path: Path) -> None:
    url = memory_url()
    fit(url, tmp_path, 2, keep_last=1)
    fs = fsspec.filesystem("memory")
    root = url[len("memory://"):]
    fs.pipe(f"{root}/epoch=0009-step=00000099.pt", b"half of a save")  # no manifest: a kill
    fs.pipe(f"{root}/notes.txt", b"the user's own object")
    store = RemoteStore(url)
    assert store.saves() == ["epoch=0001-step=00000006.pt"]
    with pytest.warns(RuntimeWarning, match="partial saves.*epoch=0009-step=00000099.pt"):
        loop = fit(url, tmp_path, 3, keep_last=1, resume=True)
    assert loop.state.step == 9
    assert "epoch=0009-step=00000099.pt" not in store.objects()
    assert "notes.txt" in store.objects()  # not a checkpoint name: not hookloop's to delete


def test_resume_false_over_an_earlier_run_and_local_only_options_are_refused(
        tmp_path: Path) -> None:
    url = memory_url()
    fit(url, tmp_path, 1)
    with pytest.raises(ConfigurationError, match="earlier run's saves.*resume=True"):
        fit(url, tmp_path, 1)
    with pytest.raises(ConfigurationError, match="storage_options is for a dirpath that is a URL"):
        Checkpoint(str(tmp_path), storage_options={})


def test_a_failed_upload_is_a_named_error_at_a_next_step(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self, local, key):
        raise PermissionError("Access Denied")

    monkeypatch.setattr(RemoteStore, "_put", refuse)
    with pytest.raises(CheckpointError, match=r"uploading the saves .* failed: PermissionError"):
        with pytest.warns(RuntimeWarning, match="not uploaded"):
            fit(memory_url(), tmp_path, 3, every_n_steps=1)


def _damage(fs, path: str, how: str, other: str) -> None:
    data = fs.cat_file(path)
    if how == "flipped":
        fs.pipe_file(path, data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif how == "truncated":
        fs.pipe_file(path, data[: len(data) // 2])
    else:  # foreign: another save's object under this name
        fs.pipe_file(path, fs.cat_file(other))


@pytest.mark.parametrize("how", ["flipped", "truncated", "foreign"])
def test_a_damaged_object_on_s3_is_refused_by_name(tmp_path: Path, s3: dict, how: str) -> None:
    url = f"s3://runs/{how}-{uuid.uuid4().hex[:6]}"
    fit(url, tmp_path, 2, keep_last=2, storage_options=s3)
    store = RemoteStore(url, s3)
    newest, older = store.path("epoch=0001-step=00000006.pt"), store.path(
        "epoch=0000-step=00000003.pt")
    _damage(store.fs, newest, how, older)
    named = r"s3://runs/.*/epoch=0001-step=00000006\.pt: "
    problem = {"flipped": "its xxh3_128 digest", "truncated": "[0-9]+ bytes, the manifest says",
               "foreign": "([0-9]+ bytes, the manifest says|its xxh3_128 digest)"}[how]
    with pytest.raises(CheckpointError, match=named + problem):
        fit(url, tmp_path, 3, keep_last=2, storage_options=s3, resume=True)
    with pytest.raises(CheckpointError, match=named + problem):
        load_checkpoint(f"{url}/epoch=0001-step=00000006.pt", torch.nn.Linear(3, 1),
                        storage_options=s3)
    fresh = torch.nn.Linear(3, 1)  # the older save, intact, still loads
    load_checkpoint(f"{url}/epoch=0000-step=00000003.pt", fresh, storage_options=s3)


def test_a_foreign_manifest_is_refused_by_name(tmp_path: Path) -> None:
    url = memory_url()
    fit(url, tmp_path, 1)
    store = RemoteStore(url)
    manifest = store.path("epoch=0000-step=00000003.pt" + MANIFEST_SUFFIX)
    store.fs.pipe_file(manifest, json.dumps({"files": {"../../etc/passwd": {}}}).encode())
    with pytest.raises(CheckpointError, match=r"\.manifest\.json: not the manifest of a hookloop"):
        load_checkpoint(f"{url}/epoch=0000-step=00000003.pt", torch.nn.Linear(3, 1))


def _rewrite_manifests(store: RemoteStore, entry_of) -> None:
    """Rewrite every manifest of ``store``, each object's entry ``entry_of(its bytes)``."""
    for name in store.saves():
        path = store.path(name + MANIFEST_SUFFIX)
        manifest = json.loads(store.fs.cat_file(path))
        for key in manifest["objects"]:
            manifest["objects"][key] = entry_of(store.fs.cat_file(store.path(key)))
        store.fs.pipe_file(path, json.dumps(manifest).encode())


def test_a_save_with_sha256_manifests_resumes_and_refuses_damage(
        tmp_path: Path) -> None:
    """Manifests written before the digest change (SHA-256 under ``digest_sha256``) verify
    and resume exactly; a flipped bit under such a manifest is refused naming SHA-256."""
    url = memory_url()
    fit(url, tmp_path, 2, keep_last=2)
    store = RemoteStore(url)
    _rewrite_manifests(store, lambda data: {"size": len(data),
                                            "digest_sha256": hashlib.sha256(data).hexdigest()})
    resumed = fit(url, tmp_path, 4, keep_last=2, resume=True)
    straight = fit(memory_url(), tmp_path, 4, keep_last=2)
    assert resumed.state.step == 12 and torch.equal(resumed.model.weight, straight.model.weight)
    url = memory_url()
    fit(url, tmp_path, 1)
    store = RemoteStore(url)
    _rewrite_manifests(store, lambda data: {"size": len(data),
                                            "digest_sha256": hashlib.sha256(data).hexdigest()})
    _damage(store.fs, store.path("epoch=0000-step=00000003.pt"), "flipped", "")
    with pytest.raises(CheckpointError, match=r"epoch=0000-step=00000003\.pt: its sha256 digest"):
        load_checkpoint(f"{url}/epoch=0000-step=00000003.pt", torch.nn.Linear(3, 1))


def test_a_manifest_naming_an_unknown_digest_algorithm_is_refused_by_name(
        tmp_path: Path) -> None:
    url = memory_url()
    fit(url, tmp_path, 1)
    store = RemoteStore(url)
    manifest = json.loads(store.fs.cat_file(store.path("epoch=0000-step=00000003.pt"
                                                       + MANIFEST_SUFFIX)))
    data = store.fs.cat_file(store.path("epoch=0000-step=00000003.pt"))
    assert manifest["objects"] == {"epoch=0000-step=00000003.pt": {
        "size": len(data), "digest_xxh3_128": xxhash.xxh3_128(data).hexdigest()}}
    _rewrite_manifests(store, lambda data: {"size": len(data), "digest_blake7": "00"})
    with pytest.raises(CheckpointError, match=r"manifest\.json: records its digests with the "
                       r"algorithm 'blake7', which this hookloop does not know"):
        load_checkpoint(f"{url}/epoch=0000-step=00000003.pt", torch.nn.Linear(3, 1))
    with pytest.raises(CheckpointError, match="'blake7'.*upgrade hookloop"):
        fit(url, tmp_path, 2, resume=True)


def test_a_second_launch_on_one_s3_url_is_refused_and_a_stale_lease_taken_over(
        tmp_path: Path, s3: dict) -> None:
    url = f"s3://runs/lease-{uuid.uuid4().hex[:6]}"
    store = RemoteStore(url, s3)
    first = RemoteLease(store, seconds=30)
    assert first.acquire() is None  # a live job (this process) holds the URL
    try:
        with pytest.raises(ConfigurationError, match=r"s3://runs/lease-.* is in use by another "
                                                     r"running job \(pid [0-9]+ on host"):
            fit(url, tmp_path, 1, storage_options=s3)
    finally:
        first.release()
    # A lease of a job on another host whose expiry passed is stale: taken over.
    store.fs.pipe_file(store.path(".hookloop.lease"), json.dumps(
        {"holder": "pid 1 on host elsewhere", "pid": 1, "host": "elsewhere", "token": "x",
         "expires": 0}).encode())
    loop = fit(url, tmp_path, 1, storage_options=s3)
    assert loop.state.step == 3
    assert ".hookloop.lease" not in store.objects()  # given back at the fit's end


def test_top_k_and_best_files_are_mirrored_as_the_staging_directory_keeps_them(
        tmp_path: Path) -> None:
    url, staging = memory_url(), tmp_path / "staging"
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(3)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:1],
                loss_fn=torch.nn.functional.mse_loss, device="cpu",
                callbacks=[Checkpoint(url, monitor="val_loss", save_top_k=2, keep_last=1,
                                      staging_dir=str(staging))])
    loop.fit(4)
    kept = sorted(path.name for path in staging.iterdir() if path.name.endswith(".pt"))
    assert len([name for name in kept if name.startswith("best-")]) == 2
    assert RemoteStore(url).saves() == kept  # pruned on the store as on the disk
    for name in kept:  # each one's bytes, read back through load_checkpoint's download
        with fetched(f"{url}/{name}") as local:
            assert Path(local).read_bytes() == (staging / name).read_bytes()
