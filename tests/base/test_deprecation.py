"""hookloop/base/deprecation.py: renamed public names keep working for one minor version, with a
HookloopDeprecationWarning naming the new spelling (issue 25, item 14). The oracle of each
alias is the new name read on the same object."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from hookloop import HookloopDeprecationWarning, Loop
import hookloop
from hookloop.base.deprecation import REMOVED_IN
from hookloop.callbacks import Checkpoint

from builders import ScriptedMetric, make_loop
from conftest import subprocess_env


def test_the_warning_is_a_deprecation_and_a_future_warning() -> None:
    assert issubclass(HookloopDeprecationWarning, DeprecationWarning)
    assert issubclass(HookloopDeprecationWarning, FutureWarning)
    assert hookloop.errors.HookloopDeprecationWarning is HookloopDeprecationWarning


def test_checkpoint_best_epoch_and_best_step_read_the_best_of_top_k(tmp_path: Path) -> None:
    """Removed when the best moved under top_k[0]: back, as aliases that warn."""
    scores = ScriptedMetric([0.3, 0.9, 0.5], "val_acc")  # best at epoch 1
    checkpoint = Checkpoint(tmp_path, monitor="val_acc")
    loop = make_loop([scores, checkpoint], val=slice(0, 1))
    with pytest.warns(HookloopDeprecationWarning, match=r"Checkpoint\.best_epoch is deprecated: "
                                                        r"use Checkpoint\.top_k\[0\]\['epoch'\]"):
        assert checkpoint.best_epoch is None  # nothing validated yet
    loop.fit(3)
    best = checkpoint.top_k[0]
    assert best["epoch"] == 1  # the scripted best
    with pytest.deprecated_call(match=rf"removed in hookloop {REMOVED_IN}"):
        assert checkpoint.best_epoch == best["epoch"]
    with pytest.warns(FutureWarning, match=r"Checkpoint\.best_step .*top_k\[0\]\['step'\]"):
        assert checkpoint.best_step == best["step"] == 8  # 4 batches per epoch, epochs 0 and 1


class _StopAt(hookloop.Callback):
    def __init__(self, batches: int) -> None:
        self.batches = batches

    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.batch_idx + 1 == self.batches:
            loop.stop()


def test_position_batch_idx_is_batches_done() -> None:
    loop = make_loop([_StopAt(3)])
    loop.fit(2)
    position = loop.position
    assert position.batches_done == 3  # stopped after 3 batches of epoch 0
    with pytest.warns(HookloopDeprecationWarning,
                      match=r"loop\.position\.batch_idx is deprecated: use "
                            r"loop\.position\.batches_done"):
        assert position.batch_idx == position.batches_done
    assert tuple(position) == (0, 3, 3)  # the alias is no field: the tuple is unchanged


@pytest.mark.slow
def test_the_warning_is_shown_by_default_from_a_module_that_is_not_main(tmp_path: Path) -> None:
    """Python hides DeprecationWarnings raised outside __main__; a published callback's
    module is such a place, so import hookloop shows this one (once per place)."""
    (tmp_path / "published_callback.py").write_text(textwrap.dedent("""
        def read(checkpoint):
            return checkpoint.best_step, checkpoint.best_step
    """))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from hookloop.callbacks import Checkpoint
        import published_callback
        print(published_callback.read(Checkpoint({str(tmp_path / 'ckpt')!r})))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120, check=True)
    assert done.stdout.strip() == "(None, None)"
    assert done.stderr.count("HookloopDeprecationWarning: Checkpoint.best_step") == 1
    assert "published_callback.py:3" in done.stderr  # it points at the reader's line


def test_the_alias_read_from_the_class_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alias = Checkpoint.best_epoch  # help(), dir() and the API listing read it so
    assert "top_k[0]['epoch']" in alias.__doc__


def test_loop_state_set_batch_warns_and_still_sets_the_batch() -> None:
    import torch

    from hookloop import Loop, LoopState

    model = torch.nn.Linear(3, 1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                [(torch.ones(2, 3), torch.zeros(2, 1))], loss_fn=torch.nn.functional.mse_loss,
                device="cpu")
    state = LoopState()
    batch = (torch.ones(2, 3), torch.zeros(2, 1))
    with pytest.warns(HookloopDeprecationWarning, match=r"set_batch is deprecated.*0\.3"):
        returned = state.set_batch(batch, 4, loop)
    assert state.batch_idx == 4 and state.batch_size == 2
    assert torch.equal(returned[0], batch[0]) and torch.equal(state.targets, batch[1])


@pytest.mark.slow
def test_the_modules_moved_into_floors_import_by_their_old_paths_with_a_warning() -> None:
    """Issue 23 moved the flat modules into subpackages; published code that imported
    `hookloop.mesh` or `hookloop.checkpoint_files` (the 0.1 docs showed both) keeps working
    until 0.3, on the very module (a monkeypatch through the old path reaches the code)."""
    script = textwrap.dedent("""
        import importlib, sys, warnings
        import hookloop
        from hookloop.base.deprecation import MOVED_MODULES
        for old, new in sorted(MOVED_MODULES.items()):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module = importlib.import_module(old)
            assert module is importlib.import_module(new), old
            assert module.__spec__.name == new, old
            assert [str(w.message).split(":")[0] for w in caught] == [f"{old} is deprecated"]
        from hookloop.mesh import Mesh
        assert Mesh is importlib.import_module("hookloop.parallel.mesh").Mesh
        print(len(MOVED_MODULES), "moved")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "39 moved" in done.stdout
