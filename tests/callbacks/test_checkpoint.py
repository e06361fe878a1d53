"""Checkpoint: file contents read back with torch.load(weights_only=True), rotation, best.pt,
atomic writes, bad files, state keys, load_checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from hookloop import CallbackOrderError, Callback, CheckpointError, ConfigurationError, Loop
import hookloop
from hookloop.callbacks import Checkpoint, EarlyStopping, Metrics
from hookloop.runfile import storage

from builders import ScriptedMetric, adam, regression_batches, two_layers
from builders import make_loop as build_loop


def make_loop(directory: Path | str, callbacks: list[Callback] | None = None, *,
              val: bool = True, batches: int = 4, model: nn.Module | None = None) -> Loop:
    """A regression run (Adam) validated on one batch of 5 drawn after the training data."""
    return build_loop([Checkpoint(directory)] if callbacks is None else callbacks,
                      model=model or (lambda: two_layers(3, 8, 1, nn.ReLU())),
                      train=lambda: regression_batches(batches),
                      val=(lambda train: regression_batches(1, size=5)) if val else None,
                      optimizer=adam(1e-2))


def names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_contents_load_with_weights_only(tmp_path: Path) -> None:
    loop = make_loop(tmp_path, [EarlyStopping(patience=3), Checkpoint(tmp_path)])
    loop.fit(2)
    path = tmp_path / "epoch=0001-step=00000008.pt"
    payload = torch.load(path, weights_only=True)
    assert payload["hookloop"]["version"] == hookloop.__version__
    assert payload["hookloop"]["kind"] == "resume"
    for name, value in loop.model.state_dict().items():
        assert torch.equal(payload["model"][name], value)
    assert payload["optimizer"]["state"][0]["step"] == 8  # Adam's own step counter
    assert payload["loop"]["epoch"] == 2 and payload["loop"]["step"] == 8
    assert payload["loop"]["batch_idx"] == 0
    rng = payload["ranks"][0]["rng"]
    assert {"python", "torch", "generators"} <= set(rng)
    assert payload["loop"]["ended"]["reason"] == "all 2 epochs are done"
    assert payload["loop"]["history"] == loop.state.history and len(loop.state.history) == 2
    assert set(payload["callbacks"]) == {"EarlyStopping", "Checkpoint"}
    assert payload["callbacks"]["EarlyStopping"]["best"] == pytest.approx(loop.state.metrics["val_loss"]) \
        or payload["callbacks"]["EarlyStopping"]["wait"] > 0
    assert payload["metrics"]["val_loss"] == loop.state.metrics["val_loss"]


def test_keep_last_counts_only_rotating_files_and_best_is_separate(tmp_path: Path) -> None:
    loop = make_loop(tmp_path, [Checkpoint(tmp_path, monitor="val_loss", keep_last=2,
                                           every_n_steps=3)])
    loop.fit(3)
    files = names(tmp_path)
    assert "best.pt" in files
    rotating = [name for name in files if name != "best.pt"]
    assert rotating == ["epoch=0002-step=00000009.pt", "epoch=0002-step=00000012.pt"]
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["hookloop"]["kind"] == "best" and best["hookloop"]["monitor"] == "val_loss"


def test_keep_last_none_keeps_every_file(tmp_path: Path) -> None:
    make_loop(tmp_path, [Checkpoint(tmp_path, keep_last=None, every_n_steps=2)]).fit(2)
    steps = sorted(int(name.split("step=")[1][:8]) for name in names(tmp_path))
    assert steps == [2, 4, 6, 8]


def test_best_follows_the_monitored_values(tmp_path: Path) -> None:
    """Scripted validation values: best.pt holds the weights of the best epoch (mode max)."""
    scripted = ScriptedMetric([0.2, 0.5, 0.4, 0.7, 0.1], by="order", weights_by="epoch")
    weights_at = scripted.weights_at
    checkpoint = Checkpoint(tmp_path, monitor="val_score", mode="max")
    make_loop(tmp_path, [scripted, checkpoint]).fit(5)
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["epoch"] == 3 and best["hookloop"]["value"] == 0.7
    for name, value in weights_at[3].items():
        assert torch.equal(best["model"][name], value)
    assert checkpoint.best == 0.7 and checkpoint.best_path == str(tmp_path / "best.pt")


def test_best_holds_the_ema_weights_it_validated(tmp_path: Path) -> None:
    from hookloop.callbacks import EMA

    ema = EMA(0.5)
    loop = make_loop(tmp_path, [ema, Checkpoint(tmp_path, monitor="val_loss")])
    loop.fit(1)
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    averaged = ema.averaged_state_dict()
    for name, value in best["model"].items():
        assert torch.equal(value, averaged[name].to(value.dtype))
    assert not torch.equal(best["model"]["0.weight"], loop.model.state_dict()["0.weight"])
    # the rotating file keeps the training weights (it is for resuming)
    rotating = torch.load(tmp_path / "epoch=0000-step=00000004.pt", weights_only=True)
    assert torch.equal(rotating["model"]["0.weight"], loop.model.state_dict()["0.weight"])


def test_write_is_atomic_when_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure in the middle of torch.save leaves the final name untouched and no temp file."""
    make_loop(tmp_path, [Checkpoint(tmp_path, keep_last=1)]).fit(1)
    good = tmp_path / "epoch=0000-step=00000004.pt"
    before = good.read_bytes()
    real_save = torch.save

    def failing_save(obj: object, handle: object) -> None:
        real_save(obj, handle)
        handle.truncate(100)  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(storage.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        make_loop(tmp_path, [Checkpoint(tmp_path, keep_last=1, resume=True)]).fit(2)
    monkeypatch.undo()
    assert names(tmp_path) == [good.name]  # no temp file, nothing pruned
    assert good.read_bytes() == before
    torch.load(good, weights_only=True)


def test_temporary_files_are_never_taken_for_checkpoints(tmp_path: Path) -> None:
    make_loop(tmp_path).fit(1)
    (tmp_path / ".tmp-abc.part").write_bytes(b"PK\x03\x04 partial")
    checkpoint = Checkpoint(tmp_path, resume=True)
    assert [Path(path).name for path in checkpoint.files.rotating()] == ["epoch=0000-step=00000004.pt"]
    make_loop(tmp_path, [checkpoint]).fit(2)
    assert not (tmp_path / ".tmp-abc.part").exists()  # cleaned at fit start


# ----------------------------------------------------------------- bad files
def good_file(tmp_path: Path) -> Path:
    make_loop(tmp_path / "good").fit(1)
    return tmp_path / "good" / "epoch=0000-step=00000004.pt"


def bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = good_file(tmp_path)
    directory = tmp_path / "bad"
    directory.mkdir()
    data = good.read_bytes()
    truncated = directory / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    empty = directory / "empty.pt"
    empty.write_bytes(b"")
    text = directory / "text.pt"
    text.write_text("hello, not a checkpoint\n")
    plain = directory / "plain.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, plain)
    unsafe = directory / "unsafe.pt"
    torch.save({"hookloop": {}, "model": {}, "thing": Path("x")}, unsafe)
    return {"truncated": (truncated, "truncated"), "empty": (empty, "empty"),
            "text": (text, "not a checkpoint"), "plain": (plain, "not a hookloop checkpoint"),
            "unsafe": (unsafe, "weights_only=True")}


def test_bad_files_raise_checkpoint_error_naming_file_and_problem(tmp_path: Path) -> None:
    for kind, (path, problem) in bad_files(tmp_path).items():
        model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
        with pytest.raises(CheckpointError) as caught:
            hookloop.load_checkpoint(path, model)
        message = str(caught.value)
        assert str(path) in message and problem in message, (kind, message)
        error = caught.value  # no unpickling traceback chained to it
        assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
        # resuming from it fails the same way, before the first batch
        loop = make_loop(tmp_path / kind, [Checkpoint(tmp_path / kind, resume=str(path))])
        with pytest.raises(CheckpointError, match=problem):
            loop.fit(1)
        assert loop.state.step == 0
        assert not list((tmp_path / kind).glob("epoch=*"))  # no checkpoint of a failed start


def test_wrong_architecture(tmp_path: Path) -> None:
    good = good_file(tmp_path)
    other = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 1))
    with pytest.raises(CheckpointError, match="wrong architecture") as caught:
        hookloop.load_checkpoint(good, other)
    assert str(good) in str(caught.value)
    loop = make_loop(tmp_path / "run", [Checkpoint(tmp_path / "run", resume=str(good))],
                     model=nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)))
    with pytest.raises(CheckpointError, match="wrong architecture"):
        loop.fit(1)


def test_resuming_into_a_changed_model_names_the_first_tensor_and_the_way_to_load_anyway(
        tmp_path: Path) -> None:
    """Issue 25, item 15: torch's whole size-mismatch list named the cause, not the fix.
    The message names the first differing tensor with both shapes, and
    load_checkpoint(strict=False), which loads what fits (checked tensor by tensor)."""
    good = good_file(tmp_path)  # Linear(3, 8), ReLU, Linear(8, 1)
    changed = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))  # another head
    loop = make_loop(tmp_path / "run", [Checkpoint(tmp_path / "run", resume=str(good))],
                     model=changed)
    with pytest.raises(CheckpointError, match=r"the first tensor that differs is '2\.weight': "
                                              r"saved \(1, 8\), the model's \(2, 8\) \(1 more "
                                              r"differ\).*load_checkpoint\(path, model, "
                                              r"strict=False\)"):
        loop.fit(1)
    assert loop.state.step == 0
    fresh_head = changed[2].weight.detach().clone()
    with pytest.warns(RuntimeWarning, match=r"loaded 2 of the model's 4 tensors.*'2\.weight'"):
        hookloop.load_checkpoint(good, changed, strict=False)
    saved = torch.load(good, weights_only=True)["model"]
    assert torch.equal(changed[0].weight, saved["0.weight"])  # what fits is loaded
    assert torch.equal(changed[0].bias, saved["0.bias"])
    assert torch.equal(changed[2].weight, fresh_head)  # the rest stays as initialized
    extra = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1), nn.Linear(1, 1))
    with pytest.raises(CheckpointError, match=r"'3\.weight': in the model, not in the file"):
        hookloop.load_checkpoint(good, extra)


def test_corrupt_newest_file_under_resume_true_raises(tmp_path: Path) -> None:
    """A run never silently starts over a directory it cannot read."""
    make_loop(tmp_path).fit(1)
    (tmp_path / "epoch=0001-step=00000008.pt").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(CheckpointError, match="epoch=0001-step=00000008.pt.*truncated"):
        make_loop(tmp_path, [Checkpoint(tmp_path, resume=True)]).fit(2)


def test_missing_resume_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        make_loop(tmp_path, [Checkpoint(tmp_path, resume=str(tmp_path / "nope.pt"))]).fit(1)


def test_best_file_is_not_a_resume_point(tmp_path: Path) -> None:
    make_loop(tmp_path, [Checkpoint(tmp_path, monitor="val_loss")]).fit(1)
    with pytest.raises(CheckpointError, match="best.pt"):
        make_loop(tmp_path, [Checkpoint(tmp_path, resume=str(tmp_path / "best.pt"))]).fit(2)


# ------------------------------------------------------------ loading, keys
def test_load_checkpoint_restores_weights_and_optimizer(tmp_path: Path) -> None:
    loop = make_loop(tmp_path)
    loop.fit(1)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    contents = hookloop.load_checkpoint(tmp_path / "epoch=0000-step=00000004.pt", model, optimizer)
    for name, value in loop.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value)
    assert optimizer.state_dict()["state"][0]["step"] == 4
    assert contents["loop"]["step"] == 4


def test_unclaimed_and_missing_state_warn_on_resume(tmp_path: Path) -> None:
    make_loop(tmp_path, [EarlyStopping(patience=3), Checkpoint(tmp_path)]).fit(1)
    with pytest.warns(RuntimeWarning, match="no callback in the stack claims: EarlyStopping"):
        make_loop(tmp_path, [Checkpoint(tmp_path, resume=True)]).fit(2)
    with pytest.warns(RuntimeWarning, match="no state for EarlyStopping.*name='second'"):
        make_loop(tmp_path, [EarlyStopping(patience=3, name="second"),
                             Checkpoint(tmp_path, resume=True)]).fit(3)


def test_state_is_restored_under_its_key(tmp_path: Path) -> None:
    first = EarlyStopping(patience=9, name="a")
    make_loop(tmp_path, [first, EarlyStopping(patience=9, name="b"), Checkpoint(tmp_path)]).fit(2)
    restored = EarlyStopping(patience=9, name="a")
    make_loop(tmp_path, [restored, EarlyStopping(patience=9, name="b"),
                         Checkpoint(tmp_path, resume=True)]).fit(2)  # nothing left to train
    assert (restored.best, restored.wait) == (first.best, first.wait)


def test_checkpoint_must_come_after_stateful_callbacks(tmp_path: Path) -> None:
    with pytest.raises(CallbackOrderError, match="EarlyStopping.*Checkpoint|Checkpoint.*EarlyStopping"):
        make_loop(tmp_path, [Checkpoint(tmp_path), EarlyStopping()]).fit(1)


def test_two_checkpoints_need_distinct_names(tmp_path: Path) -> None:
    with pytest.raises(CallbackOrderError, match="state under the key 'Checkpoint'"):
        make_loop(tmp_path, [Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")]).fit(1)
    make_loop(tmp_path, [Checkpoint(tmp_path, monitor="val_loss"),
                         Checkpoint(tmp_path, monitor="train_loss", name="by_train")]).fit(1)
    assert {"best.pt", "by_train-best.pt", "by_train-epoch=0000-step=00000004.pt"} <= set(names(tmp_path))


def test_monitor_must_be_produced(tmp_path: Path) -> None:
    with pytest.raises(CallbackOrderError, match="val_acc"):
        make_loop(tmp_path, [Checkpoint(tmp_path, monitor="val_acc")]).fit(1)
    make_loop(tmp_path, [Metrics(acc=lambda out, y: (out - y).abs().mean()),
                         Checkpoint(tmp_path, monitor="val_acc", mode="max")]).fit(1)


def test_state_that_is_not_plain_fails_at_fit_start(tmp_path: Path) -> None:
    class Holder(Callback):
        def __init__(self) -> None:
            self.batches = 0

        def on_batch_start(self, loop: Loop) -> None:
            self.batches += 1

        def state_dict(self) -> dict[str, object]:
            return {"path": Path("x")}

        def load_state_dict(self, state: dict[str, object]) -> None:
            pass

    holder = Holder()
    with pytest.raises(ConfigurationError, match=r"Holder.*'Holder'.*\['path'\].*PosixPath"):
        make_loop(tmp_path, [holder, Checkpoint(tmp_path)]).fit(1)
    assert holder.batches == 0 and names(tmp_path) == []


@pytest.mark.parametrize("kwargs", [dict(mode="up"), dict(every_n_epochs=0), dict(every_n_steps=-1),
                                    dict(keep_last=0), dict(resume=3), dict(monitor=""),
                                    dict(every_n_epochs=True)])
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Checkpoint(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_map_location_is_the_current_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_loop(tmp_path).fit(1)
    seen: list[object] = []
    real_load = torch.load

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(kwargs.get("map_location"))
        assert kwargs.get("weights_only") is True
        return real_load(*args, **kwargs)

    monkeypatch.setattr(storage.torch, "load", spy)
    make_loop(tmp_path, [Checkpoint(tmp_path, resume=True)]).fit(2)
    hookloop.load_checkpoint(tmp_path / "epoch=0001-step=00000008.pt",
                             nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1)))
    assert seen == [torch.device("cpu"), torch.device("cpu")]


def test_fit_twice_and_validate_alone(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path, monitor="val_loss")
    loop = make_loop(tmp_path, [checkpoint])
    loop.fit(1)
    loop.fit(2)
    loop.validate()
    assert loop.state.step == 8
    assert os.path.exists(tmp_path / "epoch=0001-step=00000008.pt")


# -------------------------------------------------- a new run over an earlier one
def test_a_new_run_refuses_a_directory_holding_an_earlier_run(tmp_path: Path) -> None:
    """A fresh run (resume=False) would overwrite the earlier run's better best.pt with a
    worse one and mix its rotating files with the earlier run's: it stops before any batch."""
    make_loop(tmp_path, [Checkpoint(tmp_path, monitor="val_loss", keep_last=2)]).fit(3)
    before = {name: (tmp_path / name).read_bytes() for name in names(tmp_path)}
    assert set(before) == {"best.pt", "epoch=0001-step=00000008.pt",
                           "epoch=0002-step=00000012.pt"}
    best_value = torch.load(tmp_path / "best.pt", weights_only=True)["hookloop"]["value"]
    (tmp_path / ".tmp-left.part").write_bytes(b"PK")  # temporary files are no checkpoints
    loop = make_loop(tmp_path, [Checkpoint(tmp_path, monitor="val_loss", keep_last=2)])
    with pytest.raises(ConfigurationError) as caught:
        loop.fit(1)
    message = str(caught.value)
    for part in (str(tmp_path), "best.pt", "epoch=0001-step=00000008.pt",
                 "epoch=0002-step=00000012.pt", "resume=True", "empty directory"):
        assert part in message, (part, message)
    assert ".tmp-left" not in message
    assert loop.state.step == 0  # before the first batch
    with pytest.raises(ConfigurationError):  # a retry of the same fit is refused too
        loop.fit(1)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert torch.load(tmp_path / "best.pt", weights_only=True)["hookloop"]["value"] == best_value


def test_rotating_files_alone_are_an_earlier_run_too(tmp_path: Path) -> None:
    make_loop(tmp_path).fit(1)
    with pytest.raises(ConfigurationError, match=r"epoch=0000-step=00000004\.pt"):
        make_loop(tmp_path).fit(1)
    # The same callback cannot start a second run in a new Loop: it belongs to the first.
    checkpoint = Checkpoint(tmp_path / "again")
    make_loop(tmp_path / "again", [checkpoint]).fit(1)
    with pytest.raises(ConfigurationError, match="already ran in another Loop"):
        make_loop(tmp_path / "again", [checkpoint]).fit(1)


def test_what_a_new_run_may_start_over(tmp_path: Path) -> None:
    # Temporary files only (a crash during a first save): a fresh start, and they are removed.
    tmp_path.joinpath(".tmp-abc.part").write_bytes(b"PK\x03\x04 partial")
    make_loop(tmp_path).fit(1)
    assert names(tmp_path) == ["epoch=0000-step=00000004.pt"]
    # Another name has its own files: the unnamed run's are neither overwritten nor mixed.
    make_loop(tmp_path, [Checkpoint(tmp_path, name="other")]).fit(1)
    assert names(tmp_path) == ["epoch=0000-step=00000004.pt", "other-epoch=0000-step=00000004.pt"]
    # resume=True continues the earlier run.
    assert make_loop(tmp_path, [Checkpoint(tmp_path, resume=True)]).fit(2).step == 8


def test_later_fits_of_the_same_loop_continue_in_their_directory(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path, monitor="val_loss", keep_last=1)
    loop = make_loop(tmp_path, [checkpoint])
    loop.fit(3)
    loop.fit(5)
    assert loop.state.step == 20
    assert names(tmp_path) == ["best.pt", "epoch=0004-step=00000020.pt"]
    saved = torch.load(tmp_path / "epoch=0004-step=00000020.pt", weights_only=True)
    assert saved["loop"]["step"] == 20 and saved["loop"]["epoch"] == 5


def test_each_rank_s_loss_sums_are_stored(tmp_path: Path) -> None:
    """The epoch's partial loss sums, per rank (one here), against a hand-written loop."""
    loop = make_loop(tmp_path, [Checkpoint(tmp_path, every_n_steps=3, keep_last=None)], val=False)
    data = list(loop.train_data)
    loop.fit(1)
    torch.manual_seed(0)  # the model make_loop builds
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    total = 0.0
    for inputs, targets in data[:3]:
        loss = nn.functional.mse_loss(model(inputs), targets)
        total += loss.item() * len(inputs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    saved = torch.load(tmp_path / "epoch=0000-step=00000003.pt", weights_only=True)
    assert saved["loop"]["batch_idx"] == 3
    assert [{"train_loss_sum", "train_samples"} <= set(entry) for entry in saved["ranks"]] == [True]
    assert saved["ranks"][0]["train_samples"] == 12
    assert saved["ranks"][0]["train_loss_sum"].item() == pytest.approx(total, rel=1e-6)


def test_resume_with_only_a_best_file_keeps_it_unless_beaten(tmp_path: Path) -> None:
    """A crash after best.pt but before the first rotating file: resume=True starts fresh,
    and best.pt is replaced only by a better score, never by the new run's first one."""
    import torch.nn.functional as F

    from hookloop import Loop
    from hookloop.callbacks import Checkpoint

    directory = tmp_path / "ckpt"
    directory.mkdir()
    model = torch.nn.Linear(3, 2)
    sentinel = {"hookloop": {"version": "0", "format": 1, "kind": "best", "world_size": 1,
                             "monitor": "val_loss", "value": 1e-9},
                "model": model.state_dict(), "epoch": 0, "step": 1, "metrics": {"val_loss": 1e-9}}
    torch.save(sentinel, directory / "best.pt")
    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    callback = Checkpoint(directory, monitor="val_loss", resume=True)
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data,
         loss_fn=F.cross_entropy, callbacks=[callback], device="cpu").fit(2)
    kept = torch.load(directory / "best.pt", weights_only=True)
    assert kept["hookloop"]["value"] == 1e-9  # no real run reaches that loss: untouched
    assert callback.best == 1e-9
