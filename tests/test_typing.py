"""hookloop is a typed package (issue 37, item 1): ``mypy`` is clean on ``hookloop/`` with
the project's configuration (pyproject's [tool.mypy]: strict on the public modules), and a
user's ``mypy --strict`` of the README's code blocks finds nothing to say about hookloop.

Both run mypy in a fresh process (about a minute each on 2 busy cores; its cache, in the
checkout's .mypy_cache, makes a second run faster). .ci/run's packaging step runs the
README check again against the installed wheel, whose py.typed it needs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

pytest.importorskip("mypy", reason="mypy comes with the dev extra: pip install -e '.[dev]'")


def _mypy(*arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", *arguments], cwd=cwd,
                          env=subprocess_env(), capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_mypy_is_clean_on_the_package() -> None:
    result = _mypy("--cache-dir", str(ROOT / ".mypy_cache"), cwd=ROOT)  # pyproject's config
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Success: no issues found" in result.stdout


def test_the_public_modules_are_checked_strictly() -> None:
    """The configuration the test above runs: every public module under strict's flags."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[[tool.mypy.overrides]]", 1)[1].split("[[tool.mypy.overrides]]")[0]
    modules = set(re.findall(r'"([\w.*]+)"', section.split("]", 1)[0]))
    public = {"hookloop", "hookloop.loop", "hookloop.callback", "hookloop.callbacks.*",
              "hookloop.errors", "hookloop.distributed", "hookloop.schedules",
              "hookloop.presets.*", "hookloop.testing", "hookloop.monitor",
              "hookloop.launcher", "hookloop.lr_find", "hookloop.cli"}
    assert public <= modules, sorted(public - modules)
    for flag in ("disallow_untyped_defs", "disallow_any_generics", "disallow_untyped_calls",
                 "warn_return_any", "no_implicit_reexport", "strict_equality"):
        assert f"{flag} = true" in section, flag
    assert (ROOT / "hookloop" / "py.typed").is_file()


@pytest.mark.slow
def test_a_users_strict_mypy_of_the_readme_finds_nothing_from_hookloop(tmp_path: Path) -> None:
    """What a user's type checker says of the README's examples under --strict, with the
    checkout on PYTHONPATH: mypy takes hookloop as an installed package there, which it
    reads only with a py.typed marker (without it: "module is installed, but missing
    library stubs or py.typed marker", and every hookloop name is Any)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert blocks
    script = tmp_path / "readme_examples.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir",
         str(ROOT / ".mypy_cache" / "readme"), str(script)],
        cwd=tmp_path, env={**subprocess_env(), "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
