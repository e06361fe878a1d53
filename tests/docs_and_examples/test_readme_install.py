"""The README's install steps in the order a reader copies them, and what the docs say
about accumulation (issue 19, item 12)."""

from __future__ import annotations

import re

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
    assert re.search(r"about \d+ minutes of wall time", after)
    assert "--ignore=tests/distributed --ignore=tests/docs_and_examples" in after


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
