"""hookloop.presets: the built-in stacks, lookup by name, and presets installed by packages."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, CallbackOrderError, ConfigurationError, Loop, presets
from hookloop.callbacks import (
    AMP,
    EMA,
    Checkpoint,
    EarlyStopping,
    GradAccumulation,
    GradClip,
    LRScheduler,
    Metrics,
    TerminateOnNaN,
)
from hookloop.engine.ordering import check_callbacks
from hookloop.presets import DetectAnomaly, ShortRun
from hookloop.schedules import WarmupCosine, WarmupLinear

from builders import accuracy, adamw, classification_batches, make_loop, two_layers
from conftest import ROOT, console_script, subprocess_env

QUIET = {"tensorboard": None, "progress": False}


def classification_loop(callbacks: list, batches: int = 6) -> Loop:
    model = two_layers(8, 16, 3, torch.nn.ReLU())  # after whatever the test drew before
    data = classification_batches(batches + 2, size=8, features=8)
    return make_loop(callbacks, model=model, train=data[:batches], val=data[batches:],
                     optimizer=adamw(1e-2), loss_fn=F.cross_entropy, seed=None)


def kinds(callbacks: list) -> list[type]:
    return [type(callback) for callback in callbacks]


@pytest.fixture
def only_presets_from(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Show hookloop only the presets of distributions under the given directories.

    Whatever else is installed (a third-party preset package) would change the lists of
    available names these tests compare exactly; the metadata is still read for real.
    """
    def isolate(*roots: Path) -> None:
        read = importlib.metadata.entry_points

        def entry_points(**selection: str) -> list[importlib.metadata.EntryPoint]:
            return [entry_point for entry_point in read(**selection)
                    if entry_point.dist is not None and any(
                        Path(entry_point.dist.locate_file("")).is_relative_to(root)
                        for root in roots)]

        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)

    return isolate


# ------------------------------------------------------------------ standard
def test_standard_stack_in_a_legal_order(tmp_path: Path) -> None:
    from hookloop.callbacks import ProgressBar, TensorBoard

    callbacks = presets.standard(accumulate=2, metrics={"acc": accuracy}, monitor="val_acc",
                                 checkpoint_dir=tmp_path / "ckpt", tensorboard=tmp_path / "tb")
    assert kinds(callbacks) == [AMP, GradAccumulation, GradClip, EMA, LRScheduler, Metrics,
                                EarlyStopping, TensorBoard, ProgressBar, Checkpoint]
    early_stopping, checkpoint = callbacks[6], callbacks[9]
    assert (early_stopping.monitor, early_stopping.mode, early_stopping.patience) == ("val_acc", "max", 5)
    assert (checkpoint.monitor, checkpoint.mode, checkpoint.resume) == ("val_acc", "max", False)
    loop = classification_loop(callbacks)
    check_callbacks(callbacks, loop, loop.val_data)  # the order rules hold
    state = loop.fit(2)
    assert state.step == 6 and "val_acc" in state.metrics
    assert (tmp_path / "ckpt" / "best.pt").exists()
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))


def test_standard_defaults_match_the_spec() -> None:
    callbacks = presets.standard(**QUIET)
    assert kinds(callbacks) == [AMP, GradClip, EMA, LRScheduler, EarlyStopping, Checkpoint]
    amp, clip, ema, schedule, early_stopping, checkpoint = callbacks
    assert amp.dtype == torch.bfloat16 and clip.max_norm == 1.0 and ema.decay == 0.999
    assert (early_stopping.monitor, early_stopping.mode, early_stopping.patience) == ("val_loss", "min", 5)
    assert checkpoint.dirpath == "ckpt" and checkpoint.monitor == "val_loss"
    loop = classification_loop([AMP(), schedule])
    loop.fit(1)
    scheduler = schedule.scheduler
    assert isinstance(scheduler, WarmupCosine) and scheduler.warmup_steps == round(0.05 * 6)


def test_every_part_can_be_switched_off() -> None:
    assert presets.standard(amp=None, clip=None, ema=None, schedule=None, checkpoint_dir=None,
                            tensorboard=None, early_stopping=None, progress=False) == []
    assert presets.standard(amp=False, clip=0, ema=0, schedule=False, checkpoint_dir="",
                            tensorboard="", early_stopping=0, progress=False, accumulate=None) == []
    fp16 = presets.standard(amp="fp16", **QUIET)[0]
    assert isinstance(fp16, AMP) and fp16.dtype == torch.float16


def test_monitor_none_switches_off_early_stopping_and_best() -> None:
    """The docstring and docs/presets.md: monitor=None means no early stopping (whatever
    early_stopping says) and no best.pt, rather than an error."""
    callbacks = presets.standard(monitor=None, tensorboard=None, progress=False)
    assert not any(isinstance(c, EarlyStopping) for c in callbacks)
    checkpoint = next(c for c in callbacks if isinstance(c, Checkpoint))
    assert checkpoint.monitor is None


@pytest.mark.parametrize("off", [0, False, None, 1])
def test_accumulate_off_values_add_no_grad_accumulation(off) -> None:
    kinds = [type(c).__name__ for c in presets.standard(accumulate=off, **QUIET)]
    assert "GradAccumulation" not in kinds
    assert "GradAccumulation" in [type(c).__name__
                                  for c in presets.standard(accumulate=2, **QUIET)]


def test_each_call_builds_new_callbacks() -> None:
    first, second = presets.standard(**QUIET), presets.standard(**QUIET)
    assert all(a is not b for a, b in zip(first, second))


@pytest.mark.parametrize(("arguments", "message"), [
    ({"amp": "fp32"}, "amp='fp32'"),
    ({"schedule": "cosine"}, "'warmup_cosine', 'warmup_linear'"),
    ({"warmup": 1.5}, "strictly between 0 and 1"),
    ({"warmup": -3}, "warmup must be"),
    ({"accumulate": -2}, "accumulate"),
    ({"accumulate": True}, "accumulate"),
    ({"clip": -1.0}, "clip"),
    ({"monitor": "val_thing"}, "mode='max'"),
    ({"metrics": ["acc"]}, "dict of metric functions"),
])
def test_bad_arguments_are_named(arguments: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(")):
        presets.standard(**QUIET, **arguments)


def test_mode_auto_reads_the_metric_name() -> None:
    stack = presets.standard(monitor="val_f1", mode="auto", metrics={"f1": accuracy}, **QUIET)
    assert stack[-2].mode == "max"
    stack = presets.standard(monitor="val_perplexity", **QUIET)
    assert stack[-2].mode == "min"
    stack = presets.standard(monitor="val_thing", mode="max", **QUIET)
    assert stack[-2].mode == "max"


def test_a_monitored_metric_nothing_produces_fails_before_training() -> None:
    loop = classification_loop(presets.standard(monitor="val_acc", checkpoint_dir=None, **QUIET))
    with pytest.raises(CallbackOrderError, match="val_acc"):
        loop.fit(1)


def test_resume_continues_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stack = presets.standard(checkpoint_dir=tmp_path, amp=None, **QUIET)
    classification_loop(stack).fit(1)
    resumed = classification_loop(presets.standard(checkpoint_dir=tmp_path, amp=None,
                                                   resume=True, **QUIET))
    assert resumed.fit(2).step == 12
    assert "resumed from" in capsys.readouterr().out


# ------------------------------------------------------------------ finetune, debug
def test_finetune_is_warmup_linear_without_ema() -> None:
    callbacks = presets.finetune(**QUIET)
    assert kinds(callbacks) == [AMP, GradClip, LRScheduler, Checkpoint]
    schedule = callbacks[2]
    loop = classification_loop([schedule], batches=10)
    loop.fit(1)
    scheduler = schedule.scheduler
    assert isinstance(scheduler, WarmupLinear) and scheduler.warmup_steps == 1
    cosine = presets.finetune(schedule="warmup_cosine", checkpoint_dir=None, **QUIET)
    assert kinds(cosine) == [AMP, GradClip, LRScheduler]


def test_debug_stack_runs_short_with_anomaly_detection_first() -> None:
    from hookloop.callbacks import ModelSummary, Profiler

    callbacks = presets.debug()
    assert kinds(callbacks) == [ModelSummary, TerminateOnNaN, DetectAnomaly, ShortRun, Profiler]
    seen = []

    class RecordAnomalyMode(Callback):
        def on_batch_start(self, loop: Loop) -> None:
            seen.append(torch.is_anomaly_enabled())

    stack = presets.debug(steps=6, anomaly_steps=2, summary=False, profile=False)
    loop = classification_loop(stack + [RecordAnomalyMode()], batches=4)
    state = loop.fit(5)
    assert state.step == 6 and "ShortRun" in (loop.stop_reason or "")
    assert seen == [True, True, False, False, False, False]
    assert not torch.is_anomaly_enabled()


@pytest.mark.filterwarnings("ignore:Error detected in SqrtBackward")
def test_detect_anomaly_names_the_forward_that_made_a_nan() -> None:
    model = torch.nn.Linear(2, 1)

    def forward(loop: Loop, batch: tuple) -> tuple:
        outputs = loop.model(batch[0])
        return outputs, torch.sqrt(outputs.sum() * 0 - 1)  # sqrt(-1): NaN in backward

    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                [(torch.randn(4, 2), torch.randn(4, 1))], forward=forward, device="cpu",
                callbacks=[DetectAnomaly(steps=1)])
    with pytest.raises(RuntimeError, match="SqrtBackward"):
        loop.fit(1)
    assert not torch.is_anomaly_enabled()


def test_debug_combines_with_another_preset(tmp_path: Path) -> None:
    stack = presets.debug(steps=3, summary=False, profile=False) + presets.standard(
        checkpoint_dir=tmp_path, **QUIET)
    loop = classification_loop(stack)
    assert loop.fit(2).step == 3


# ------------------------------------------------------------------ editing
def test_replace_insert_and_remove_keep_positions() -> None:
    callbacks = presets.standard(**QUIET)
    presets.replace(callbacks, GradClip, GradClip(0.5))
    assert callbacks[1].max_norm == 0.5
    presets.replace(callbacks, "EMA", None)
    assert EMA not in kinds(callbacks)
    callbacks.insert(callbacks.index(next(c for c in callbacks if isinstance(c, Checkpoint))),
                     Metrics(acc=accuracy))
    assert kinds(callbacks)[-2:] == [Metrics, Checkpoint]
    with pytest.raises(ConfigurationError, match="no callback in the stack match 'EMA'"):
        presets.replace(callbacks, "EMA", None)


# ------------------------------------------------------------------ lookup
def test_available_lists_the_built_ins_with_one_line_each() -> None:
    listed = presets.available()
    assert {"standard", "finetune", "debug"} <= set(listed)
    assert all(description and "\n" not in description for description in listed.values())


def test_get_builds_by_name_and_reports_unknown_names(
        only_presets_from: Callable[..., None]) -> None:
    only_presets_from()  # the built-ins only
    assert kinds(presets.get("finetune", checkpoint_dir=None, **QUIET)) == [AMP, GradClip, LRScheduler]
    with pytest.raises(ConfigurationError, match=r"No preset named 'standart'\. Did you mean "
                                                 r"'standard'\? Available: debug, finetune, standard"):
        presets.get("standart")
    with pytest.raises(ConfigurationError, match=r"unexpected keyword argument 'emma'.*ema=0\.999"):
        presets.get("standard", emma=0.9)


def _distribution(root: Path, name: str, presets_: dict[str, str], modules: dict[str, str]) -> None:
    """A package installed in ``root`` the way pip lays it out: its module and dist-info."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[hookloop.presets]\n" + "".join(f"{key} = {value}\n" for key, value in presets_.items()))
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)


GOOD = '''
from hookloop.callbacks import GradClip

def tight(max_norm=0.1):
    """Clip hard: every gradient norm above 0.1 is cut."""
    return [GradClip(max_norm)]

def not_a_list():
    """Returns the wrong thing."""
    return GradClip(1.0)
'''


def test_installed_presets_are_found_and_broken_ones_reported_by_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        only_presets_from: Callable[..., None]) -> None:
    only_presets_from(tmp_path)
    _distribution(tmp_path, "good-presets", {"tight": "hl_test_good:tight",
                                             "not_a_list": "hl_test_good:not_a_list"},
                  {"hl_test_good": GOOD})
    _distribution(tmp_path, "broken-presets", {"broken": "hl_test_broken:preset"},
                  {"hl_test_broken": "import a_module_that_is_not_installed\n"})
    _distribution(tmp_path, "greedy-presets", {"standard": "hl_test_good:tight",
                                               "twice": "hl_test_good:tight"}, {})
    _distribution(tmp_path, "copycat-presets", {"twice": "hl_test_good:tight"}, {})
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.warns(RuntimeWarning) as caught:
        listed = presets.available()
    messages = "\n".join(str(warning.message) for warning in caught)
    assert listed["tight"] == "Clip hard: every gradient norm above 0.1 is cut."
    assert "broken" not in listed and "twice" not in listed
    assert "'broken' from broken-presets 1.0" in messages and "ModuleNotFoundError" in messages
    assert "'standard' from greedy-presets 1.0" in messages and "built-in" in messages
    assert "'twice'" in messages and "none of them is used" in messages
    assert presets.get("standard", **QUIET)[0].__class__ is AMP  # the built-in stays

    callbacks = presets.get("tight", max_norm=0.2)
    assert kinds(callbacks) == [GradClip] and callbacks[0].max_norm == 0.2
    with pytest.raises(ConfigurationError, match="'broken' from broken-presets 1.0 cannot be used"):
        presets.get("broken")
    with pytest.raises(ConfigurationError, match="not a list of hookloop.Callback"):
        presets.get("not_a_list")
    with pytest.raises(ConfigurationError, match="Available: debug, finetune, not_a_list, "
                                                 "standard, tight"), pytest.warns(RuntimeWarning):
        presets.get("nothing")


@pytest.mark.slow
def test_the_community_example_package_installs_and_is_listed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, target = tmp_path / "source", tmp_path / "site"
    shutil.copytree(ROOT / "examples" / "community_preset", source)
    # Offline: no build isolation (setuptools is already installed), no dependencies.
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    assert (target / "hookloop_quick_cpu").is_dir()

    env = subprocess_env()
    env["PYTHONPATH"] = str(target) + ":" + env["PYTHONPATH"]
    command = console_script()
    listed = subprocess.run([command, "presets"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if line.startswith("quick_cpu"))
    assert "hookloop-quick-cpu 0.1.0" in line and "Full precision" in line

    monkeypatch.syspath_prepend(str(target))
    assert presets.available()["quick_cpu"].startswith("Full precision, clipping")
    callbacks = presets.get("quick_cpu", clip=0.5)
    assert kinds(callbacks) == [TerminateOnNaN, GradClip, LRScheduler]
    assert classification_loop(callbacks).fit(1).step == 6

    # The template's own tests (hookloop.testing on the installed preset) pass.
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(source / "tests")], cwd=source, env=env, capture_output=True,
                           text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert "4 passed" in tests.stdout, tests.stdout[-2000:]
