"""At fit end, rank 0 prints one line saying why training ended, with the epoch numbered as
the progress display numbers it (issue 19 item 1). Read from real subprocesses."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import subprocess_env

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.nn.functional as F
    from hookloop import Loop
    from hookloop.callbacks import EarlyStopping, ProgressBar

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    case = sys.argv[1]
    lr = 0.0 if case == "early" else 0.1  # a frozen model never improves
    callbacks = [ProgressBar()]
    if case == "early":
        callbacks.append(EarlyStopping(patience=2))
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=lr), data, val_data=data,
                loss_fn=F.mse_loss, device="cpu", callbacks=callbacks)
    loop.fit(10 if case == "early" else 2, max_steps=4 if case == "steps" else None)
    if case == "again":
        loop.fit(2)  # nothing left to train: it says so before, and prints no end line
""")


def _run(tmp_path: Path, case: str) -> str:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script), case], env=subprocess_env(),
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("case, line", [
    ("early", "hookloop: training ended at epoch 3/10, step 9: EarlyStopping: val_loss did not "
              "improve for 2 validations (best "),
    ("epochs", "hookloop: training ended at epoch 2/2, step 6: all 2 epochs are done."),
    ("steps", "hookloop: training ended at epoch 2/2, step 4: max_steps=4 reached."),
])
@pytest.mark.slow
def test_the_end_of_the_run_says_why_in_one_line(tmp_path: Path, case: str, line: str) -> None:
    output = _run(tmp_path, case)
    ended = [text for text in output.splitlines() if text.startswith("hookloop: training ended")]
    assert len(ended) == 1 and ended[0].startswith(line), output


@pytest.mark.slow
def test_early_stopping_names_its_best_epoch_as_the_display_does(tmp_path: Path) -> None:
    output = _run(tmp_path, "early")
    # The frozen model's first validation is its best: epoch 1 in the display's numbering.
    assert "at epoch 1)." in output
    assert "epoch 1/10" in output  # the display's own numbering of that epoch


@pytest.mark.slow
def test_a_fit_with_nothing_to_train_prints_no_end_line(tmp_path: Path) -> None:
    output = _run(tmp_path, "again")
    assert output.count("hookloop: training ended") == 1
    assert "all 2 epochs of this run are done, so this fit trains nothing" in output
