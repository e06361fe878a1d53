"""The documentation site (issue 37, item 2): every page of docs/ is in mkdocs.yml's nav,
``mkdocs build --strict`` succeeds (a broken link or reference fails it), and every public
name of tests/public_api.txt has an entry in the generated API reference: an anchor of
its own, or (a method inherited from torch, a parameter) its name in its owner's entry.

The browser check (tools/check_site_in_browser.py, headless Chromium) runs in .ci/run.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

#: Names the public API listing spells by a path the reference documents under another
#: (a class listed under its module's path before the floors; the function hidden by its
#: module's name, see tools/docs_hooks.documented_path).
RENAMED = {"hookloop.position.RunPosition": "hookloop.engine.position.RunPosition",
           "hookloop.lr_find": "hookloop.lr_find.lr_find"}


def test_every_docs_page_is_in_the_site_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?([\w./-]+\.md)\s*$", config, re.MULTILINE))
    pages = {path.relative_to(ROOT / "docs").as_posix()
             for path in (ROOT / "docs").rglob("*.md")}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    generated = {"readme.md", "changelog.md"} | {name for name in nav if name.startswith("api/")}
    assert nav - pages - generated == set(), f"nav entries with no page: {nav - pages - generated}"


class Reference:
    """The built API pages: each anchor ``hookloop...`` with the text of its entry (up to
    the next anchor that is not one of its members)."""

    def __init__(self, site: Path) -> None:
        self.entries: dict[str, str] = {}
        for page in sorted((site / "api").glob("*.html")):
            text = page.read_text(encoding="utf-8")
            anchors = [(match.group(1), match.start())
                       for match in re.finditer(r'id="(hookloop[\w.]*)"', text)]
            for index, (name, start) in enumerate(anchors):
                end = next((later for other, later in anchors[index + 1:]
                            if not other.startswith(name + ".")), len(text))
                plain = html.unescape(re.sub(r"<[^>]+>", "", text[start:end]))
                self.entries.setdefault(name, re.sub(r"\s+", " ", plain))

    def covers(self, line: str) -> bool:
        for old, new in RENAMED.items():
            if line == old or line.startswith((old + ".", old + "(")):
                line = new + line[len(old):]
        parameter = re.fullmatch(r"([\w.]+)\((\w+)\)", line)
        if parameter is None:
            if line in self.entries:
                return True
            owner, _, member = line.rpartition(".")
            return bool(re.search(rf"\b{member}\(", self.entries.get(owner, "")))
        path, name = parameter.groups()
        if path in self.entries:
            return bool(re.search(rf"\b{name}\b", self.entries[path]))
        owner, _, method = path.rpartition(".")  # a method inherited from another library
        return bool(re.search(rf"\b{method}\([^)]*\b{name}\b", self.entries.get(owner, "")))


@pytest.mark.slow
def test_the_site_builds_strictly_and_documents_every_public_name(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                             "--site-dir", str(site)], cwd=ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    reference = Reference(site)
    # Whitespace aside: with black or ruff installed, mkdocstrings lays a signature out.
    assert "fit(epochs:int,*,max_steps" in "".join(reference.entries["hookloop.Loop.fit"].split())
    listed = [line for line in (ROOT / "tests" / "public_api.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    missing = [line for line in listed if not reference.covers(line)]
    assert missing == [], f"{len(missing)} public names without an API entry: {missing[:40]}"
    assert (site / "readme.html").is_file() and (site / "changelog.html").is_file()
