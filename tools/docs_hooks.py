"""mkdocs hooks for the documentation site (mkdocs.yml names this file).

- The API reference: one page per public module, ``api/<name>.md``, generated at each build
  from the module's ``__all__`` (a ``::: module.name`` entry per public name, rendered by
  mkdocstrings from the docstrings), so a new public name is on its page without an edit.
- README.md and CHANGELOG.md, which live beside docs/, become the pages ``readme.md`` and
  ``changelog.md``: the links to them from docs/ are pointed there, the README's links into
  docs/ lose their ``docs/`` prefix, and a link to another file of the repository (outside
  the site) becomes that path as code, so that ``--strict`` still fails on a broken link.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from griffe import Attribute, Extension

ROOT = Path(__file__).resolve().parent.parent

#: The API pages: page name -> (module, title line).
API_PAGES = {
    "hookloop": ("hookloop", "The package: the loop, the callback base class, the errors, "
                             "the mesh, checkpoints and the learning-rate finder."),
    "callbacks": ("hookloop.callbacks", "The built-in callbacks."),
    "errors": ("hookloop.errors", "The errors hookloop raises, and its deprecation warning."),
    "presets": ("hookloop.presets", "Presets: ready-made stacks, and publishing your own."),
    "schedules": ("hookloop.schedules", "Learning-rate schedules (see also "
                                        "[schedules](../schedules.md))."),
    "distributed": ("hookloop.distributed", "Rank queries and collectives that also work in "
                                            "one process."),
    "testing": ("hookloop.testing", "The test kit for callback and preset authors (see also "
                                    "[testing](../testing.md))."),
}
#: Public classes no ``__all__`` names, documented on the package's page (the public API
#: listing, tests/test_public_api.py, names them the same way).
EXTRA = {"hookloop": ["hookloop.engine.position.RunPosition"]}
#: Pages of the repository root shown on the site: file -> page.
ROOT_PAGES = {"README.md": "readme.md", "CHANGELOG.md": "changelog.md"}
_LINK = re.compile(r"\[([^\]]*)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def _init_tuple_attributes(class_node: ast.ClassDef) -> list[tuple[str, int]]:
    """The public names a class sets by tuple assignment, in its body (``library, extra =
    "mlflow", "mlflow"``) or as ``self.name`` in ``__init__`` (``self.model,
    self.optimizer = model, optimizer``), with their lines."""
    found = [(item.attr if isinstance(item, ast.Attribute) else item.id, node.lineno)
             for node in class_node.body if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Tuple)
             for item in target.elts if isinstance(item, ast.Name)
             and not item.id.startswith("_")]  # the class's own ``a, b = 1, 2``
    for function in class_node.body:
        if isinstance(function, ast.FunctionDef) and function.name == "__init__":
            for node in ast.walk(function):
                for target in getattr(node, "targets", []):
                    for item in target.elts if isinstance(target, ast.Tuple) else []:
                        if (isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name)
                                and item.value.id == "self" and not item.attr.startswith("_")):
                            found.append((item.attr, node.lineno))
    return found


class TupleAttributes(Extension):
    """A griffe extension (mkdocs.yml loads it): attributes ``__init__`` sets by tuple
    assignment, which griffe's visitor does not record, become members of their class
    (the loop's ``model``, ``optimizer``, ``state``...), so the API reference lists them."""

    def on_class_members(self, *, node: Any, cls: Any, agent: Any, **kwargs: Any) -> None:
        if not isinstance(node, ast.ClassDef):
            return
        for name, line in _init_tuple_attributes(node):
            if name not in cls.members:
                attribute = Attribute(name, lineno=line, endlineno=line)
                attribute.labels.add("instance-attribute")
                cls.set_member(name, attribute)


def _public_classes() -> set[type]:
    """The classes the reference documents on their own (named by a public ``__all__``)."""
    classes: set[type] = set()
    for module_name, _ in API_PAGES.values():
        module = importlib.import_module(module_name)
        classes |= {value for value in (getattr(module, name) for name in module.__all__)
                    if isinstance(value, type)}
    return classes


def _inherited(cls: type) -> list[str]:
    """The public names ``cls`` gets from bases the reference does not document on their
    own (hookloop's private or internal bases, torch's scheduler base): they are listed on
    ``cls``, as the public API listing lists them. Python's own and a documented base's
    (``Callback``'s events) are not repeated."""
    documented = _public_classes()
    names: set[str] = set()
    for base in cls.__mro__[1:]:
        if not base.__module__.startswith("hookloop") or base in documented:
            continue  # Python's, another library's (see `_foreign`), or on its own page
        names |= {name for name in vars(base) if not name.startswith("_")}
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base))).body[0]
        except (OSError, TypeError, SyntaxError):
            continue
        if isinstance(tree, ast.ClassDef):
            names |= {name for name, _ in _init_tuple_attributes(tree)}
            init = next((item for item in tree.body if isinstance(item, ast.FunctionDef)
                         and item.name == "__init__"), None)
            for node in ast.walk(init) if init is not None else []:
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id == "self" and not target.attr.startswith("_")):
                        names.add(target.attr)
    return sorted(names - set(vars(cls)))


def _foreign(cls: type) -> str:
    """The public methods ``cls`` inherits from another library's class (torch's scheduler
    base), which a static reader of hookloop's source cannot follow: one line each."""
    lines = []
    for base in cls.__mro__[1:]:
        if base.__module__.startswith(("hookloop", "builtins")):
            continue
        methods = [f"`{name}{inspect.signature(value)}`".replace("(self, ", "(").replace(
            "(self)", "()") for name, value in sorted(vars(base).items())
            if not name.startswith("_") and callable(value) and name not in vars(cls)]
        if methods:
            lines.append(f"Inherited from `{base.__module__}.{base.__qualname__}`: "
                         + ", ".join(methods) + ".")
    return "\n\n".join(lines)


def documented_path(module_name: str, name: str) -> str:
    """The path a public name is documented under: ``module.name``, unless a submodule of
    that path hides it from a static reader (``hookloop.lr_find``, both a module and the
    function the package exports): then the object's own module path."""
    target = getattr(importlib.import_module(module_name), name)
    if (not isinstance(target, type(sys)) and importlib.util.find_spec(f"{module_name}.{name}")
            if module_name == "hookloop" or "." not in module_name else False):
        return f"{target.__module__}.{target.__qualname__}"
    return f"{module_name}.{name}"


def api_page(page: str) -> str:
    """The markdown of one API page: the module's docstring, then every public name."""
    module_name, summary = API_PAGES[page]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(module_name)
    lines = [f"# {module_name}", "", summary, "",
             f"::: {module_name}", "    options:", "      members: false",
             "      show_root_heading: false", ""]
    names = [name for name in getattr(module, "__all__", []) if not name.startswith("__")]
    for name in sorted(names, key=str.lower):
        target = getattr(module, name)
        if type(target).__name__ == "module":  # a submodule has its own page
            lines += [f"## `{module_name}.{name}` {{ #{module_name}.{name} }}", "",
                      f"The module: [{target.__name__}]({target.__name__.split('.')[-1]}.md).",
                      ""]
            continue
        options = ["    options:", "      heading_level: 2"]
        inherited = _inherited(target) if isinstance(target, type) else []
        if inherited:
            options.append(f"      inherited_members: {inherited}")
        lines += [f"::: {documented_path(module_name, name)}", *options, ""]
        if getattr(target, "__signature__", None) is not None:  # set at run time
            lines += [f"Its signature, with every argument: `{name}{inspect.signature(target)}`.",
                      ""]
        if isinstance(target, type) and _foreign(target):
            lines += [_foreign(target), ""]
    if hasattr(module, "__version__"):
        lines += [f"::: {module_name}.__version__", "    options:", "      heading_level: 2", ""]
    for path in EXTRA.get(page, []):
        lines += [f"::: {path}", "    options:", "      heading_level: 2", ""]
    return "\n".join(lines)


def root_page(name: str) -> str:
    """README.md or CHANGELOG.md with its links made to work from the site's root."""
    text = (ROOT / name).read_text(encoding="utf-8")

    def relink(match: re.Match[str]) -> str:
        label, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        if "://" in target or target.startswith("mailto:"):
            return match.group(0)
        if target.startswith("docs/"):
            return f"[{label}]({target[len('docs/'):]}{anchor})"
        if target in ROOT_PAGES:
            return f"[{label}]({ROOT_PAGES[target]}{anchor})"
        return f"{label} (`{target}` in the repository)"  # a file the site does not hold

    return _LINK.sub(relink, text)


def on_config(config: Any) -> Any:
    """hookloop's docstrings head their doctests ``Example:``, which griffe's Google parser
    reads as an admonition of plain text (its examples section is ``Examples:``), so the
    doctests' output lines rendered as markdown. The singular is mapped to the same section
    (griffe's table is private: the docs extra pins the version this was written for, and a
    griffe without it fails the build here, loudly)."""
    from griffe import DocstringSectionKind
    from griffe._internal.docstrings import google

    google._section_kind.setdefault("example", DocstringSectionKind.examples)
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for page in API_PAGES:
        files.append(File.generated(config, f"api/{page}.md", content=api_page(page)))
    for source, page in ROOT_PAGES.items():
        files.append(File.generated(config, page, content=root_page(source)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Links from docs/ to README.md and CHANGELOG.md go to their pages on the site."""
    depth = page.file.src_uri.count("/")
    for source, target in ROOT_PAGES.items():
        markdown = markdown.replace(f"]({'../' * (depth + 1)}{source}",
                                    f"]({'../' * depth}{target}")
    return markdown
