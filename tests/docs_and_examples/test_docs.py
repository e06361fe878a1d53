"""Every ```python block of README.md and docs/ runs: a file's blocks in order, in a fresh process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
DOCUMENTS = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")])


def python_blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text(encoding="utf-8"))


def test_every_document_is_collected() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in DOCUMENTS}
    assert {"README.md", "docs/concepts.md", "docs/writing-callbacks.md"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(document: Path, tmp_path: Path) -> None:
    blocks = python_blocks(document)
    if not blocks:
        pytest.skip(f"{document.name} has no python block")
    script = tmp_path / "blocks.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"{document.name}: a python block failed\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-5000:]}")


def test_every_callback_page_is_linked_from_the_index() -> None:
    """A page nothing links to is a page nobody finds: docs/index.md lists every callback
    page (one line each), and README's "Learn more" points there."""
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((callbacks/[\w-]+\.md)\)", index))
    pages = {f"callbacks/{path.name}" for path in (ROOT / "docs" / "callbacks").glob("*.md")}
    assert pages - linked == set(), f"not linked from docs/index.md: {sorted(pages - linked)}"
    assert linked <= pages, f"links to missing pages: {sorted(linked - pages)}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    learn_more = readme.split("## Learn more", 1)[1]
    assert "](docs/index.md#built-in-callbacks)" in learn_more


def test_every_page_is_reachable_from_the_index() -> None:
    """Issue 37: docs/lr-find.md was linked from nowhere. Every page under docs/ is reached
    from docs/index.md by following the pages' relative links."""
    link = re.compile(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)")
    docs = ROOT / "docs"
    seen: set[Path] = set()
    todo = [docs / "index.md"]
    while todo:
        page = todo.pop().resolve()
        if page in seen or not page.is_file() or docs.resolve() not in page.parents:
            continue
        seen.add(page)
        todo += [page.parent / target for target in link.findall(page.read_text("utf-8"))]
    pages = {path.resolve() for path in docs.glob("**/*.md")}
    unreached = sorted(path.relative_to(docs.resolve()).as_posix() for path in pages - seen)
    assert unreached == [], f"pages no link from docs/index.md reaches: {unreached}"
