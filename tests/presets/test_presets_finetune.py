"""presets.finetune is standard with other defaults: the same signature, docs and stacks as
when it repeated standard's 14 parameters.

Two oracles: the reprs and the signature the earlier finetune gave (recorded from it, as
literals), and standard called by hand with finetune's documented defaults, compared on
every attribute of every callback.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest
import torch

from hookloop import ConfigurationError, presets


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=-1) == targets).float().mean()


def constant(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


# Argument sets and the reprs the earlier finetune (commit 56d8743) built for them.
CASES: list[tuple[dict[str, Any], str]] = [
    ({}, "[AMP(dtype=torch.bfloat16, scaler=False), GradClip(max_norm=1.0), LRScheduler(factory), "
         "TensorBoard('runs', every_n_steps=50), ProgressBar(), Checkpoint('ckpt', "
         "monitor='val_loss')]"),
    ({"tensorboard": None, "progress": False, "checkpoint_dir": None},
     "[AMP(dtype=torch.bfloat16, scaler=False), GradClip(max_norm=1.0), LRScheduler(factory)]"),
    ({"amp": "fp16", "accumulate": 4, "ema": 0.99, "monitor": "val_acc",
      "metrics": {"acc": accuracy}, "early_stopping": 3, "checkpoint_dir": "x", "resume": True,
      "progress": False},
     "[AMP(dtype=torch.float16, scaler=True), GradAccumulation(4), GradClip(max_norm=1.0), "
     "EMA(decay=0.99), LRScheduler(factory), Metrics(acc), EarlyStopping(monitor='val_acc', "
     "mode='max', patience=3), TensorBoard('runs', every_n_steps=50), Checkpoint('x', "
     "monitor='val_acc')]"),
    ({"schedule": "warmup_cosine", "warmup": 5, "clip": None, "amp": None, "monitor": None,
      "tensorboard": "tb"},
     "[LRScheduler(factory), TensorBoard('tb', every_n_steps=50), ProgressBar(), "
     "Checkpoint('ckpt')]"),
    ({"schedule": constant, "monitor": "train_loss", "mode": "min", "early_stopping": 2},
     "[AMP(dtype=torch.bfloat16, scaler=False), GradClip(max_norm=1.0), LRScheduler(factory), "
     "EarlyStopping(monitor='train_loss', mode='min', patience=2), TensorBoard('runs', "
     "every_n_steps=50), ProgressBar(), Checkpoint('ckpt', monitor='train_loss')]"),
]

# The documented defaults where finetune differs from standard.
FINETUNE_DEFAULTS = {"ema": None, "schedule": "warmup_linear", "warmup": 0.1,
                     "early_stopping": None}

SIGNATURE = (
    "(*, amp: 'str | torch.dtype | None' = 'bf16', clip: 'float | None' = 1.0, "
    "accumulate: 'int | None' = 1, ema: 'float | None' = None, schedule: "
    "'str | Callable[[torch.optim.Optimizer, int], Any] | None' = 'warmup_linear', "
    "warmup: 'int | float' = 0.1, checkpoint_dir: 'str | os.PathLike[str] | None' = 'ckpt', "
    "tensorboard: 'str | os.PathLike[str] | None' = 'runs', early_stopping: 'int | None' = "
    "None, metrics: 'Mapping[str, Any] | Callback | None' = None, monitor: 'str | None' = "
    "'val_loss', mode: 'str' = 'auto', resume: 'bool | str | os.PathLike[str]' = False, "
    "progress: 'bool' = True, tracker: 'str | Callback | None' = None) -> 'list[Callback]'")


def _plain(value: Any) -> Any:
    """A value with no object addresses in it: comparable between two built stacks."""
    if isinstance(value, functools.partial):
        return ("partial", _plain(value.func), _plain(value.args), _plain(value.keywords))
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return f"{value.__module__}.{value.__qualname__}"
    text = repr(value)
    if " at 0x" in text:  # a helper object (a Monitor, a metric pass): its own attributes
        return (type(value).__qualname__, _plain(vars(value)) if hasattr(value, "__dict__")
                else text.split(" at 0x")[0])
    return text


def _stack(callbacks: list) -> list:
    return [(type(callback).__qualname__, _plain(vars(callback))) for callback in callbacks]


@pytest.mark.parametrize(("arguments", "expected"), CASES)
def test_finetune_builds_what_it_built_before(arguments: dict[str, Any], expected: str) -> None:
    built = presets.finetune(**arguments)
    assert repr(built) == expected
    by_hand = presets.standard(**{**FINETUNE_DEFAULTS, **arguments})
    assert _stack(built) == _stack(by_hand)
    assert _stack(presets.get("finetune", **arguments)) == _stack(by_hand)


def test_finetune_keeps_its_signature_and_docstring() -> None:
    assert str(inspect.signature(presets.finetune)) == SIGNATURE
    doc = inspect.getdoc(presets.finetune) or ""
    assert doc.splitlines()[0] == ("Fine-tune a pretrained model: bf16, clipping at 1.0, warmup "
                                   "then linear decay, no EMA.")
    assert "It is `standard` with\nthose defaults" in doc
    assert presets.available()["finetune"] == doc.splitlines()[0]


def test_finetune_refuses_what_it_refused_before() -> None:
    unexpected = r"^finetune\(\) got an unexpected keyword argument 'emma'$"
    with pytest.raises(TypeError, match=unexpected):
        presets.finetune(emma=0.9)
    with pytest.raises(TypeError, match="positional"):
        presets.finetune("bf16")
    with pytest.raises(ConfigurationError, match=r"unexpected keyword argument 'emma'.*"
                                                 r"warmup=0\.1.*early_stopping=None"):
        presets.get("finetune", emma=0.9)
    with pytest.raises(ConfigurationError, match="accumulate must be an int >= 1, got -2"):
        presets.finetune(accumulate=-2)
