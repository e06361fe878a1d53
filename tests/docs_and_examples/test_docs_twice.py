"""The first python block of README.md (and of docs/index.md and docs/presets.md) is what a
newcomer copies into train.py and runs, usually more than once, in the same directory. Its
Checkpoint refuses a directory holding an earlier run's files (it never overwrites a run),
so the snippets pass resume=True: the second run continues the first or, once it has
ended, trains nothing and says why. Either way it must not fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env
from test_docs import python_blocks


@pytest.mark.slow
@pytest.mark.parametrize("document", ["README.md", "docs/index.md", "docs/presets.md"])
def test_first_block_runs_twice_in_one_directory(document: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(python_blocks(ROOT / document)[0], encoding="utf-8")
    outputs = []
    for attempt in (1, 2):
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=subprocess_env(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{document}, run {attempt}:\n{result.stderr[-3000:]}"
        outputs.append(result.stdout)
    assert "already ended" in outputs[1], outputs[1]  # the second run says why it trains nothing
