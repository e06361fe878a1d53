"""hookloop.base.compat: the one module that touches private torch APIs, and its public fallbacks.

The fallbacks are checked against the fused private calls and against hand computations,
with the private name removed from torch for the test (monkeypatch). An ``ast`` scan
checks that no other module of hookloop reaches a private torch attribute.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, Loop
from hookloop.base import compat
from hookloop.callbacks import AMP

PACKAGE = Path(__file__).resolve().parents[2] / "hookloop"

#: Private attributes of torch objects (an optimizer, a GradScaler, a SummaryWriter, a
#: compiled module, a scheduler, a sampler) that hookloop has used or might.
KNOWN_PRIVATE = frozenset({
    "_step_supports_amp_scaling", "_get_scale_async", "_scale", "_growth_tracker",
    "_per_optimizer_states", "_get_file_writer", "_orig_mod", "_last_lr", "_num_samples",
    "_get_closed_form_lr",
})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _known(name: str) -> bool:
    return name in KNOWN_PRIVATE or name.startswith("_foreach_")


def _torch_names(tree: ast.AST) -> set[str]:
    """Names a module binds to torch or to something imported from torch."""
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_torch_uses(source: str) -> list[str]:
    """``line: code`` for every place ``source`` touches a private torch attribute.

    Pragmatic, not complete: an attribute starting with ``_`` on an expression rooted at a
    name bound to torch (``torch._foreach_lerp_``, ``dist._x``); a known private attribute
    of a torch object on any expression (``optimizer._step_supports_amp_scaling``), also
    as a string (``getattr(scaler, "_get_scale_async")``, ``"_orig_mod" in vars(model)``)
    or as a method that overrides it (``def _get_closed_form_lr``); an import of a private
    torch module or name.
    """
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if _root(node) in torch_names or _known(node.attr):
                found.add((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _known(node.name):
            found.add((node.lineno, f"def {node.name}"))  # overrides a private torch hook
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _known(node.value):
            found.add((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr", "delattr") and \
                len(node.args) >= 2 and _root(node.args[0]) in torch_names:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and \
                    _private(name.value):
                found.add((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(_private(part) for part in node.module.split(".")) or any(
                    _private(alias.name) for alias in node.names):
                found.add((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch" and any(_private(part) for part in parts):
                    found.add((node.lineno, ast.unparse(node)))
    return [f"{line}: {code}" for line, code in sorted(found)]


def test_the_scan_finds_each_kind_of_private_use() -> None:
    source = '''
import torch
import torch.distributed as dist
from torch.optim import Adam
from torch._dynamo import eval_frame
import torch._inductor.config
torch._foreach_mul_(grads, 2.0)
dist._functional_collectives
Adam._x
optimizer._step_supports_amp_scaling = False
getattr(scaler, "_get_scale_async", None)
hasattr(torch, "_foreach_copy_")
"_orig_mod" in vars(model)
writer._get_file_writer()
torch.nn.functional.mse_loss
self._private_of_ours
loop._restore
batch._fields
class Schedule(LRScheduler):
    def _get_closed_form_lr(self): ...
'''
    found = private_torch_uses(source)
    assert [entry.split(":")[0] for entry in found] == [
        "5", "6", "7", "8", "9", "10", "11", "12", "12", "13", "14", "20"], found


def test_no_module_but_compat_touches_a_private_torch_attribute() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "base" / "compat.py":
            continue
        uses = private_torch_uses(path.read_text(encoding="utf-8"))
        if uses:
            offenders[path.relative_to(PACKAGE.parent).as_posix()] = uses
    assert offenders == {}, f"use hookloop.base.compat for these: {offenders}"


# ------------------------------------------------------------------------- fallbacks
def _tensors() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    targets = [torch.randn(3, generator=generator), torch.randn(2, 2, generator=generator)]
    sources = [torch.randn(3, generator=generator), torch.randn(2, 2, generator=generator)]
    return targets, sources


@pytest.mark.parametrize("fused", [True, False])
def test_foreach_helpers_fused_and_fallback(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    if not fused:
        for name in ("_foreach_copy_", "_foreach_lerp_", "_foreach_mul_"):
            monkeypatch.delattr(torch, name)
    targets, sources = _tensors()
    compat.foreach_copy_(targets, sources)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))

    targets, sources = _tensors()
    expected = [t + 0.3 * (s - t) for t, s in zip(targets, sources)]  # by hand
    compat.foreach_lerp_(targets, sources, 0.3)
    assert all(torch.allclose(t, e, atol=1e-7) for t, e in zip(targets, expected))

    targets, _ = _tensors()
    expected = [t * 2.5 for t in targets]
    compat.foreach_mul_(targets, 2.5)
    assert all(torch.equal(t, e) for t, e in zip(targets, expected))


def test_loss_scale_with_and_without_the_private_call() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    scaler.scale(torch.ones(()))
    fused = compat.loss_scale(scaler)
    assert isinstance(fused, torch.Tensor) and float(fused) == 64.0

    class PublicOnly:  # a GradScaler of a torch without the private call
        def is_enabled(self) -> bool:
            return True

        def get_scale(self) -> float:
            return 64.0

    fallback = compat.loss_scale(PublicOnly())  # type: ignore[arg-type]
    assert isinstance(fallback, torch.Tensor) and float(fallback) == 64.0
    assert compat.loss_scale(torch.amp.GradScaler("cpu", enabled=False)) is None


def test_summary_file_writer_fallback(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    try:
        assert compat.summary_file_writer(writer) is writer.file_writer
    finally:
        writer.close()

    class PublicOnly:
        file_writer = object()

    assert compat.summary_file_writer(PublicOnly()) is PublicOnly.file_writer


def test_compiled_original() -> None:
    inner = torch.nn.Linear(2, 2)

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._orig_mod = inner  # what torch.compile's OptimizedModule holds

    assert compat.compiled_original(Wrapper()) is inner
    assert compat.compiled_original(inner) is None


class InfOnce(Callback):
    """Infinite gradients on the first weight at batch ``batch`` (the loss stays finite)."""

    def __init__(self, batch: int) -> None:
        self.batch, self.handle = batch, None

    def on_batch_start(self, loop: Loop) -> None:
        if loop.state.batch_idx == self.batch:
            self.handle = loop.unwrapped_model.weight.register_hook(
                lambda grad: torch.full_like(grad, float("inf")))

    def on_batch_end(self, loop: Loop) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def test_generic_grad_scaler_step_restores_the_flag() -> None:
    model = torch.nn.Linear(2, 1)
    fused = torch.optim.Adam(model.parameters(), fused=True)
    assert fused._step_supports_amp_scaling is True
    with pytest.raises(RuntimeError), compat.generic_grad_scaler_step(fused):
        assert fused._step_supports_amp_scaling is False
        raise RuntimeError("inside")
    assert fused._step_supports_amp_scaling is True and "_step_supports_amp_scaling" in vars(fused)

    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with compat.generic_grad_scaler_step(plain):
        pass
    assert not getattr(plain, "_step_supports_amp_scaling", False)


def test_a_fused_optimizer_under_amp_float16_does_not_count_a_skipped_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    before: dict[int, torch.Tensor] = {}

    class Weights(Callback):
        def on_batch_start(self, loop: Loop) -> None:
            before[loop.state.batch_idx] = loop.unwrapped_model.weight.detach().clone()

    loop = Loop(model, optimizer, data, loss_fn=F.mse_loss, device="cpu",
                callbacks=[Weights(), InfOnce(batch=1), amp])
    loop.fit(1)
    assert amp.skipped_steps == 1 and loop.state.step == 3
    assert torch.equal(before[1], before[2])  # the skipped step left the weights alone
    assert optimizer._step_supports_amp_scaling is True


def test_forget_compiled_drops_the_cache_of_each_wrapped_code_object() -> None:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
    model(torch.ones(1, 2)).sum().backward()
    torch.compile(optimizer.step, backend="eager")()
    codes = []
    function = type(optimizer).step
    while function is not None:
        codes.append(function.__code__)
        function = getattr(function, "__wrapped__", None)
    assert sum(len(_debug_get_cache_entry_list(code)) for code in codes) > 0
    compat.forget_compiled(optimizer.step)  # a bound method: through __func__
    assert all(not _debug_get_cache_entry_list(code) for code in codes)
    torch._dynamo.reset()
