"""`import hookloop` (and hookloop.callbacks, hookloop.export) leaves tensorboard, torchinfo,
rich and safetensors (an optional extra: only an export imports it) unimported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import subprocess_env

HEAVY = ("tensorboard", "torch.utils.tensorboard", "torchinfo", "rich", "safetensors",
         "fsspec", "s3fs", "gcsfs", "moto")  # object stores: only a Checkpoint URL's fit


@pytest.mark.slow
def test_import_hookloop_does_not_import_display_libraries() -> None:
    code = ("import json, sys, hookloop, hookloop.callbacks, hookloop.export; "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], env=subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
