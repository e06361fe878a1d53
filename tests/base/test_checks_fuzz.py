"""Fuzz every public constructor argument of Loop (and fit) and of each built-in callback.

Each case replaces one argument of a working setup by a wrong type or an out-of-range
value. It must be rejected early, by a hookloop error that names the argument (or the bad
value): when the object is built, or when ``fit`` starts, before the first batch. Only a
value that exists only when called (what a metric function returns) may be named at its
first call. The counts are printed (``pytest -s``) and written to ``fuzz_counts.json`` in
the test's temporary directory.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookloop import HookloopError, Loop
import hookloop
from hookloop.callbacks import (
    AMP,
    DDP,
    EMA,
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    GradAccumulation,
    GradClip,
    LRScheduler,
    Metrics,
    ModelSummary,
    Profiler,
    ProgressBar,
    TensorBoard,
    TerminateOnNaN,
)

from builders import BatchCounter, make_loop, regression_batches, regression_dataset


class Fresh:
    """A bad value made anew for each use (a generator is used up once iterated)."""

    def __init__(self, make: Callable[[], Any], label: str) -> None:
        self.make, self.label = make, label

    def __repr__(self) -> str:
        return self.label


def _dataset() -> TensorDataset:
    return regression_dataset(12, features=3, outputs=1, seed=0)


def _mean_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).abs().mean()


def _constant_schedule(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _generator() -> Any:
    return ((inputs, targets) for inputs, targets in DataLoader(_dataset(), batch_size=4))


NON_BOOLS = ["yes", 1, None]
NAMES = [3, "", ["a"]]
POSITIVE_INTS = [0, -1, 1.5, "2", True]

#: class -> (working keyword arguments given a temporary directory, {argument: bad values}).
CALLBACKS: dict[type, tuple[Callable[[Path], dict[str, Any]], dict[str, list[Any]]]] = {
    AMP: (lambda directory: {"dtype": torch.float16}, {
        "dtype": ["fp32", torch.float32, 3, [], None],
        "scaler": ["yes", 3, {"init_scal": 2.0}, {"growth_factor": 1.0},
                   {"backoff_factor": 2.0}, {"init_scale": -1.0}, {"growth_interval": 0}],
        "name": NAMES,
    }),
    EMA: (lambda directory: {}, {
        "decay": [-0.1, 1.0, 1.5, "0.9", True, math.nan],
        "every_n_steps": POSITIVE_INTS,
        "validate_with_ema": NON_BOOLS,
        "buffers": ["avg", 3, []],
        "warmup": NON_BOOLS,
        "start_step": [-1, 1.5, "2", True],
        "name": NAMES,
    }),
    GradAccumulation: (lambda directory: {"steps": 2}, {"steps": [*POSITIVE_INTS, None]}),
    GradClip: (lambda directory: {"max_norm": 1.0}, {
        "max_norm": [0, -1.0, "1", True, math.nan],
        "max_value": [0, -1.0, "x"],
        "norm_type": ["fro", 0, -2.0, None, True, math.nan],
    }),
    LRScheduler: (lambda directory: {"scheduler": _constant_schedule}, {
        "scheduler": [None, 3, "cosine"],
        "interval": ["batch", 3, None],
        "monitor": [3, ["val_loss"]],
        "name": NAMES,
    }),
    Checkpoint: (lambda directory: {"dirpath": directory / "ckpt"}, {
        "dirpath": [None, 3, "", Fresh(lambda: _a_file(), "a path that is a file")],
        "monitor": [3, "", "val_los"],
        "mode": ["maximum", 3],
        "every_n_epochs": POSITIVE_INTS,
        "every_n_steps": POSITIVE_INTS,
        "keep_last": POSITIVE_INTS,
        "resume": [3, None, "missing.pt"],
        "name": ["a/b", 3, ""],
        "save_top_k": [0, -1, 1.5, "2", True],
        "initial_value_threshold": ["0.5", [1]],
    }),
    DDP: (lambda directory: {}, {
        "backend": [123, "", ["gloo"]],
        "find_unused_parameters": NON_BOOLS,
    }),
    EarlyStopping: (lambda directory: {}, {
        "monitor": [3, "", "val_los"],
        "mode": ["maximum", 3],
        "patience": POSITIVE_INTS,
        "min_delta": [-1.0, math.nan, "0.1", True],
        "baseline": ["0.5", math.nan, True],
        "start_from_epoch": [-1, 1.5, "1", True],
        "stopping_threshold": ["0.1", math.inf],
        "divergence_threshold": ["9", math.nan],
        "check_finite": NON_BOOLS,
        "restore_best_weights": NON_BOOLS,
        "name": NAMES,
    }),
    Metrics: (lambda directory: {"error": _mean_error, "on_train": True}, {
        "on_train": NON_BOOLS,
        "name": NAMES,
        "targets": [3, "label"],
        "outputs": [3, "logits"],
        "error": [3, "accuracy", Fresh(lambda: lambda outputs, targets: "high",
                                       "a function returning a str")],
    }),
    TerminateOnNaN: (lambda directory: {}, {
        "check_gradients": NON_BOOLS,
        "restore_buffers": NON_BOOLS,
        "raise_error": NON_BOOLS,
    }),
    TensorBoard: (lambda directory: {"log_dir": directory / "runs"}, {
        "log_dir": [3, "", None],
        "every_n_steps": POSITIVE_INTS,
        "histograms_every_n_epochs": POSITIVE_INTS,
        "graph": NON_BOOLS,
        "hparams": [3, "lr=0.1", ["lr"]],
    }),
    ProgressBar: (lambda directory: {"console": None}, {
        "console": [3, "stdout"],
        "terminal": ["yes", 1],
        "refresh_per_second": [0, -1.0, "4", True],
    }),
    ModelSummary: (lambda directory: {"print_summary": False}, {
        "input_size": [-1, "1x3", [0, 3], [[1, 3], "x"]],
        "depth": [-1, 1.5, "3", True],
        "print_summary": NON_BOOLS,
    }),
    CSVLogger: (lambda directory: {"path": directory / "log.csv"}, {
        "path": [3, "", None],
        "every_n_steps": POSITIVE_INTS,
    }),
    Profiler: (lambda directory: {"print_table": False}, {
        "sync_cuda": NON_BOOLS,
        "console": [3, "stdout"],
        "print_table": NON_BOOLS,
    }),
}

_A_FILE: list[Path] = []


def _a_file() -> Path:
    return _A_FILE[0]


def _other_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1)


LOOP: dict[str, list[Any]] = {
    "model": [None, "model", nn.Linear, 3],
    "optimizer": [None, "sgd", torch.optim.SGD, Fresh(_other_optimizer, "another model's optimizer")],
    "train_data": [None, 3, "abc", Fresh(_dataset, "a Dataset"), torch.randn(4, 3),
                   Fresh(_generator, "a generator")],
    "val_data": [3, "abc", Fresh(_dataset, "a Dataset"), torch.randn(4, 3),
                 Fresh(_generator, "a generator")],
    "loss_fn": ["mse", 3, nn.MSELoss],
    "forward": ["f", 3, nn.Module],
    "callbacks": [None, Fresh(TerminateOnNaN, "one callback, no list"), "x", [3],
                  [TerminateOnNaN], 3],
    "device": ["gpu", True, -1, 1.5, "cuda:x",
               *([] if torch.cuda.is_available() else ["cuda", 3])],
    "val_every_n_epochs": POSITIVE_INTS,
    "val_every_n_steps": POSITIVE_INTS,
    "sanity_val_batches": [-1, 1.5, "2", True],
}
FIT: dict[str, list[Any]] = {
    "epochs": [-1, 1.5, "2", True, None],
    "max_steps": [0, -1, 1.5, "3", True],
}


@dataclass
class Outcome:
    case: str
    where: str  # construction, fit start, first call, late, unclear, accepted
    detail: str


def _value(value: Any) -> Any:
    return value.make() if isinstance(value, Fresh) else value


def _names_it(error: BaseException, argument: str, value: Any) -> bool:
    text = str(error).lower()
    shown = [argument.lower(), repr(value).lower()]
    if isinstance(value, (str, os.PathLike)) and str(value):
        shown.append(str(value).lower())
    if isinstance(value, type):
        shown.append(value.__name__.lower())
    return any(item in text for item in shown)


def _loop(directory: Path, extra: list[Any], counter: BatchCounter, **overrides: Any) -> Loop:
    torch.manual_seed(0)
    model = overrides.pop("model", nn.Linear(3, 1))
    arguments: dict[str, Any] = {
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1) if isinstance(
            model, nn.Module) else torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1),
        "train_data": DataLoader(_dataset(), batch_size=4),
        "val_data": DataLoader(_dataset(), batch_size=4),
        "loss_fn": nn.functional.mse_loss, "device": "cpu",
        "callbacks": [counter, *extra],
    }
    arguments.update(overrides)
    return Loop(model, arguments.pop("optimizer"), arguments.pop("train_data"), **arguments)


def _fit(case: str, argument: str, value: Any, build: Callable[[], Loop],
         fit: dict[str, Any] | None = None, counter: BatchCounter | None = None) -> Outcome:
    """Build (the Loop or the callback inside ``build``), then fit; say where it failed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loop = build()
    except HookloopError as error:
        named = _names_it(error, argument, value)
        return Outcome(case, "construction" if named else "unclear", f"unnamed: {error}")
    except Exception as error:  # noqa: BLE001 - what the fuzz looks for
        return Outcome(case, "unclear", f"{type(error).__name__}: {error}")
    counter = counter or next(c for c in loop.callbacks if isinstance(c, BatchCounter))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loop.fit(**(fit or {"epochs": 2}))
    except HookloopError as error:
        if not _names_it(error, argument, value):
            return Outcome(case, "unclear", f"unnamed: {error}")
        seen = counter.batches
        where = "fit start" if seen == 0 else ("first call" if seen == 1 else "late")
        return Outcome(case, where, str(error)[:200])
    except Exception as error:  # noqa: BLE001
        return Outcome(case, "unclear", f"{type(error).__name__}: {str(error)[:200]}")
    return Outcome(case, "accepted", "no error")


def run_fuzz(directory: Path) -> list[Outcome]:
    outcomes: list[Outcome] = []
    _A_FILE[:] = [directory / "a_file"]
    _A_FILE[0].write_text("not a directory")
    for index, (cls, (defaults, bad)) in enumerate(CALLBACKS.items()):
        for argument, values in bad.items():
            for number, value in enumerate(values):
                case_directory = directory / f"{cls.__name__}-{argument}-{number}"
                case_directory.mkdir()
                made = _value(value)
                kwargs = {**defaults(case_directory), argument: made}
                counter = BatchCounter(validation=True)

                def build(kwargs: dict[str, Any] = kwargs, counter: BatchCounter = counter,
                          cls: type = cls, case_directory: Path = case_directory) -> Loop:
                    return _loop(case_directory, [cls(**kwargs)], counter)

                with _in(case_directory):
                    outcomes.append(_fit(f"{cls.__name__}({argument}={value!r})", argument,
                                         made, build, counter=counter))
    for argument, values in LOOP.items():
        for value in values:
            counter = BatchCounter(validation=True)
            made = _value(value)
            if argument == "callbacks" and isinstance(made, list):
                made = [counter, *made]  # keep the batch counter in a list of callbacks

            def build(argument: str = argument, made: Any = made,
                      counter: BatchCounter = counter) -> Loop:
                return _loop(directory, [], counter, **{argument: made})

            outcomes.append(_fit(f"Loop({argument}={value!r})", argument, made, build,
                                 counter=counter))
    for argument, values in FIT.items():
        for value in values:
            counter = BatchCounter(validation=True)
            fit = {"epochs": 2, argument: value}
            outcomes.append(_fit(f"fit({argument}={value!r})", argument, value,
                                 lambda counter=counter: _loop(directory, [], counter), fit,
                                 counter=counter))
    return outcomes


class _in:
    def __init__(self, directory: Path) -> None:
        self.directory, self.previous = directory, os.getcwd()

    def __enter__(self) -> None:
        os.chdir(self.directory)

    def __exit__(self, *exc: object) -> None:
        os.chdir(self.previous)


#: Values that exist only when called: named at the first call is as early as possible.
FIRST_CALL_ALLOWED = {"Metrics(error=a function returning a str)"}


def test_every_bad_argument_is_rejected_early_and_named(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    outcomes = run_fuzz(tmp_path)
    counts = Counter(outcome.where for outcome in outcomes)
    summary = {"tried": len(outcomes), **dict(sorted(counts.items()))}
    (tmp_path / "fuzz_counts.json").write_text(json.dumps(summary, indent=1))
    with capsys.disabled():
        print(f"\nfuzz of constructor arguments: {json.dumps(summary)}")
    wrong = [outcome for outcome in outcomes
             if not (outcome.where in ("construction", "fit start")
                     or (outcome.where == "first call" and outcome.case in FIRST_CALL_ALLOWED))]
    assert not wrong, "\n".join(f"{o.case}: {o.where}: {o.detail}" for o in wrong)
    assert len(outcomes) >= 150


# ------------------------------------------------------------ outside the table


def _bad_callback_cases():
    """Bad arguments of the callbacks whose every flag and path the table above leaves out."""
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


@pytest.mark.parametrize("label,make", _bad_callback_cases(),
                         ids=[case[0] for case in _bad_callback_cases()])
def test_bad_arguments_of_the_unfuzzed_callbacks_are_named_errors(tmp_path: Path, label,
                                                                  make) -> None:
    """Each is a hookloop error (never a raw TypeError or AttributeError, never accepted)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(hookloop.HookloopError):  # oracle: the bad-input rule of issue 9
            make_loop([make(tmp_path)], train=regression_batches(4, seed=1)).fit(1)
