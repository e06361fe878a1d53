"""Review 3: bugs found in the fault handling (each test fails on the reviewed code)."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import hookloop
from hookloop import Callback, Loop
from hookloop.callbacks import AMP, Checkpoint
from hookloop.callbacks import amp as amp_module
from hookloop import checkpoint_files as checkpoint_module  # where Checkpoint's writes go
from hookloop import storage


def _data(count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(count)]


def _loop(callbacks: list[Callback], data=None) -> Loop:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data or _data(),
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=callbacks)


# 1. An interrupt (Ctrl-C, or SIGTERM's Terminated) that lands during a routine save loses
#    that save: on_exception believes the position is on disk already.
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, hookloop.Terminated])
def test_interrupt_during_a_routine_save_still_leaves_a_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: type[BaseException]) -> None:
    real = checkpoint_module.write_atomic
    calls = []

    def interrupted_once(payload, path):
        calls.append(path)
        if len(calls) == 1:  # the signal arrives while torch.save runs
            raise interrupt()
        return real(payload, path)

    monkeypatch.setattr(checkpoint_module, "write_atomic", interrupted_once)
    loop = _loop([Checkpoint(tmp_path)])
    with pytest.raises(interrupt):
        loop.fit(2)
    # Oracle: the docs ("the exception path saves a resumable checkpoint") and an interrupt
    # at any other line, which leaves epoch=0000-step=00000004.pt.
    assert len(calls) == 2, f"on_exception did not retry the interrupted save: {calls}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0000-step=00000004.pt"]


# 2. best.pt under save_top_k > 1 is made by link_atomic, whose failures are not turned
#    into CheckpointWriteError (a raw OSError naming a temporary path, or none).
def test_a_full_disk_while_linking_best_pt_is_a_checkpoint_write_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
    data = _data()
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data,
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[Checkpoint(tmp_path, monitor="val_loss", save_top_k=2)])
    with pytest.raises(hookloop.CheckpointError) as caught:  # storage.py's contract
        loop.fit(1)
    assert "best.pt" in str(caught.value) and "disk is full" in str(caught.value)
    assert not [name for name in os.listdir(tmp_path) if storage.is_temporary(name)]


# 3. The MIN_SCALE floor is applied only after a step the scaler skipped; a step a callback
#    cancels (a "skip the bad batch" policy) is paired with scaler.update() in
#    _finish_cancelled_step, which backs the scale off with no floor: it reaches 0.
class SkipNonFiniteBatches(Callback):
    runs_after = {"AMP": "reads unscaled gradients"}

    def before_step(self, loop: Loop) -> None:
        grads = [p.grad for p in loop.optimizer.param_groups[0]["params"] if p.grad is not None]
        if not all(torch.isfinite(g).all() for g in grads):
            loop.cancel_step()


def test_amp_scale_never_reaches_zero_when_steps_are_cancelled() -> None:
    data = _data(210)
    for inputs, _ in data[:200]:
        inputs[0, 0] = float("inf")
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    loop = _loop([amp, SkipNonFiniteBatches()], data=data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loop.fit(1)
    # Oracle: AMP's documented floor (docs/when-things-go-wrong.md: "The scale is never
    # allowed below 2**-16"); and the 10 clean batches at the end must be stepped.
    assert amp.scaler.get_scale() >= amp_module.MIN_SCALE, amp.scaler.get_scale()
    assert loop.state.step == 10


# 4. One damaged byte in the zip64 end-of-central-directory locator escapes as a raw
#    zipfile.BadZipFile: read_payload's zipfile.is_zipfile() pre-check only catches OSError.
@pytest.mark.parametrize("offset", [4, 16])  # disk number / total number of disks
def test_a_flipped_byte_in_the_zip64_locator_is_a_checkpoint_error(tmp_path: Path,
                                                                   offset: int) -> None:
    path = tmp_path / "best.pt"
    torch.save({"hookloop": {"format": 2, "kind": "best"},
                "model": {"weight": torch.ones(1, 3), "bias": torch.ones(1)}}, path)
    raw = bytearray(path.read_bytes())
    locator = raw.rfind(b"PK\x06\x07")
    assert locator > 0
    raw[locator + offset] ^= 0x02  # disk 2 / 3 disks
    path.write_bytes(bytes(raw))
    with pytest.raises(hookloop.CheckpointError):  # oracle: read_payload's contract
        hookloop.load_checkpoint(path, nn.Linear(3, 1))


# 5. Fields of the wrong type inside a well-formed payload still raise raw errors without
#    the file name: a callback's state, a rank's RNG state.
@pytest.mark.parametrize("where,value", [
    (("callbacks", "EarlyStopping"), 5),
    (("callbacks", "EarlyStopping"), {"best": "x"}),
    (("ranks", 0, "rng", "torch"), "abc"),
])
def test_a_wrong_field_type_is_a_checkpoint_error_naming_the_file(
        tmp_path: Path, where: tuple, value: object) -> None:
    from hookloop.callbacks import EarlyStopping

    def make(directory: Path, resume: object) -> Loop:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        data = _data(2)
        return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data,
                    loss_fn=nn.functional.mse_loss, device="cpu",
                    callbacks=[EarlyStopping("val_loss"), Checkpoint(directory, resume=resume)])

    make(tmp_path / "a", False).fit(1)
    (good,) = (tmp_path / "a").iterdir()
    payload = torch.load(good, weights_only=True)
    target = payload
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    bad = tmp_path / "bad.pt"
    torch.save(payload, bad)
    with pytest.raises(hookloop.CheckpointError, match="bad.pt"):
        make(tmp_path / "b", str(bad)).fit(2)


# 6. Unmet "Done when": the fuzz covers 10 of the 15 callbacks. The other five accept
#    non-bool flags silently or fail raw (TypeError/AttributeError) at fit.
def _bad_callback_cases():
    from hookloop.callbacks import CSVLogger, ModelSummary, Profiler, ProgressBar, TensorBoard
    return [
        ("CSVLogger(path=3)", lambda d: CSVLogger(path=3)),
        ("TensorBoard(log_dir=3)", lambda d: TensorBoard(log_dir=3)),
        ("TensorBoard(graph='yes')", lambda d: TensorBoard(log_dir=d / "tb", graph="yes")),
        ("Profiler(console='x')", lambda d: Profiler(console="x")),
        ("Profiler(print_table='yes')", lambda d: Profiler(print_table="yes")),
        ("ProgressBar(console=3)", lambda d: ProgressBar(console=3)),
        ("ProgressBar(terminal='x')", lambda d: ProgressBar(terminal="x")),
        ("ModelSummary(print_summary='yes')", lambda d: ModelSummary(print_summary="yes")),
        ("ModelSummary(input_size=-1)", lambda d: ModelSummary(input_size=-1)),
    ]


@pytest.mark.parametrize("label,make", _bad_callback_cases(), ids=[c[0] for c in _bad_callback_cases()])
def test_bad_arguments_of_the_unfuzzed_callbacks_are_named_errors(tmp_path: Path, label, make) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(hookloop.HookloopError):  # oracle: issue 9's bad-input rule
            _loop([make(tmp_path)]).fit(1)
