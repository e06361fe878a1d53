"""The README's install steps in the order a reader copies them, and what the docs say
about accumulation (issue 19, item 12)."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def install_block() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", README, re.MULTILINE | re.DOTALL)
    block = next(block for block in blocks if 'pip install -e ".[dev]"' in block)
    return block.splitlines()


def test_the_cpu_build_comes_before_the_command_that_would_pull_a_cuda_build() -> None:
    lines = install_block()
    cpu = next(index for index, line in enumerate(lines)
               if "download.pytorch.org/whl/cpu" in line)
    editable = next(index for index, line in enumerate(lines) if "pip install -e" in line)
    assert cpu < editable
    before_block = README.split("```bash", 1)[0]
    assert "CPU build first" in before_block  # said before the reader reaches the commands


def test_the_readme_says_how_long_the_tests_take() -> None:
    after = README.split('pip install -e ".[dev]"', 1)[1].split("## Why", 1)[0]
    assert re.search(r"about\s+\d+\s+minutes\s+of\s+wall\s+time", after)
    quick = after.index('python -m pytest -m "not slow"')
    assert quick < after.index("The whole")  # the quick check is named first, with its time
    assert re.search(r"about \d+\s+minutes", after[:quick])


def test_no_page_says_accumulation_needs_data_with_a_length() -> None:
    """GradAccumulation reads data without a length one batch ahead (tested in
    tests/callbacks/test_grad_accumulation*.py): no page may say it needs one."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    claims = [f"{page.relative_to(ROOT)}: {sentence.strip()}" for page in pages
              for sentence in re.split(r"(?<=\.)\s", page.read_text(encoding="utf-8"))
              if re.search(r"accumulat|GradAccumulation|window", sentence)
              and re.search(r"needs a length|needs? `?len\(|without one, setup raises",
                            sentence)]
    assert claims == []


@pytest.mark.slow
def test_the_cpu_line_gives_up_on_an_unreachable_index_and_the_readme_gives_the_fallback(
        tmp_path) -> None:
    """Issue 28, item 2: where PyTorch's index cannot be reached, the README's first line
    fails (its --timeout/--retries flags are pip's own, so pip runs it and gives up instead
    of retrying), and the README names the fallback: torch from an index that is reachable."""
    import shlex
    import subprocess
    import sys

    line = next(line for line in install_block() if "download.pytorch.org/whl/cpu" in line)
    command = [word for word in shlex.split(line.split("#", 1)[0]) if "=" not in word[:20]]
    assert command[:2] == ["pip", "install"] and "--timeout" in command and "--retries" in command
    # The same command against an index nothing listens on (the discard port of this host).
    unreachable = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-cache-dir",
                   "--ignore-installed", *["http://127.0.0.1:9/simple" if word.startswith("https://download")
                     else word for word in command[2:]]]
    quiet = {"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": "/dev/null"}  # no user's pip.conf
    result = subprocess.run(unreachable, capture_output=True, text=True, timeout=240,
                            cwd=tmp_path, env=quiet)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # 2 would be a usage error: an option pip lacks
    assert "no such option" not in output
    assert "No matching distribution found for torch" in output, output
    after = README.split("download.pytorch.org/whl/cpu", 1)[1].split("## Why", 1)[0]
    assert "cannot be reached" in after and "`pip install torch`" in after


@pytest.mark.slow
def test_the_cpu_line_ignores_a_mirror_in_any_pip_configuration(tmp_path) -> None:
    """Issue 37 item 7: an extra-index-url in a pip configuration (a mirror) was searched
    beside PyTorch's CPU index, and pip resolved a CUDA torch from it. The README's line,
    run as written with a mirror in the user's and the global pip.conf and in PIP_*
    variables, looks in PyTorch's index only (pip's "Looking in indexes" line)."""
    import shlex
    import subprocess
    import sys

    line = next(line for line in install_block() if "download.pytorch.org/whl/cpu" in line)
    words = shlex.split(line.split("#", 1)[0])
    assignments = dict(word.split("=", 1) for word in words if "=" in word[:20])
    command = [word for word in words if "=" not in word[:20]]
    assert command[:2] == ["pip", "install"]
    mirror = "[global]\nextra-index-url = http://127.0.0.1:9/mirror-from-config\n"
    for folder in (tmp_path / "home" / ".config" / "pip", tmp_path / "xdg" / "pip"):
        folder.mkdir(parents=True)
        (folder / "pip.conf").write_text(mirror, encoding="utf-8")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"),
           "XDG_CONFIG_DIRS": str(tmp_path / "xdg"),
           "PIP_EXTRA_INDEX_URL": "http://127.0.0.1:9/mirror-from-env", **assignments}
    # PyTorch's index swapped for one nothing listens on: the test needs no network.
    arguments = ["http://127.0.0.1:9/simple" if word.startswith("https://download") else word
                 for word in command[2:]]
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run",
                             "--no-cache-dir", "--ignore-installed", *arguments],
                            capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    output = result.stdout + result.stderr
    assert "Looking in indexes: http://127.0.0.1:9/simple\n" in output, output
    assert "mirror-from" not in output, output
