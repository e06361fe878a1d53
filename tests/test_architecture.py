"""The floors of the package, enforced on every change (issue 23, items 3 and 4).

docs/architecture.md is the source: its table names every module of the package with
its floor. This test reads that table and checks the code against it:

- every module is named there, and every module named there exists;
- a module imports only modules of its own floor or the floors below it, counting every
  import: at the top of the module, inside functions, and type-only ones under
  ``TYPE_CHECKING``. The one edge left out is the callback base's type-only import of
  the loop (``Callback.on_fit_start(loop: Loop)``);
- no import cycle at all: not through imports made inside functions, not between two
  modules of one floor;
- only the modules above the loop import ``hookloop.loop``, and no function below the
  loop takes a ``loop`` parameter (helpers are handed values, not the loop);
- no module over 400 logic lines; no module importing more than 10 of the package's
  modules (loop.py and the two packages that only re-export, ``hookloop`` and
  ``hookloop.callbacks``, are exempt); no function over 20 branches;
- a re-exporting module's imports count to its importer (issue 34, item 5): a name
  imported from a module that only re-exports (``hookloop``, ``hookloop.callbacks``, and
  any module whose body is only imports and ``__all__``) counts as the module that defines
  it, so that no module stays within its import budget by importing through a
  pass-through. A whole re-exporting module imported by name (``import hookloop.callbacks
  as built_ins``) counts as that one module. The built-in presets, whose job is to stack
  the built-in callbacks, have the rest of their imports counted (``STACK_BUILDERS``);
- budgets keep slack (issue 34, item 5): no measure sits at its limit. "At its limit" is
  read as "equal to it": every measure is strictly below its limit (at most 399 logic
  lines, 9 imports, 19 branches; loop.py at most 299 logic lines and ``_train_epoch`` 39;
  callbacks/checkpoint.py at most 299 lines and 9 imports), so the next change that needs
  a line, an import or a branch does not have to reshape a seam to find it;
- each key of the run file is spelled in exactly one module, the module of the part that
  reads it (its ``KEYS``; the envelope's are ``hookloop/runfile/format.py``'s): no other
  module holds one of those strings as a constant.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_size_budget import (
    CHECKPOINT_LINES,
    LOOP_LOGIC_LINES,
    TRAIN_EPOCH_LOGIC_LINES,
    function,
    logic_lines,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hookloop"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: The floors, lowest first. A module may import its own floor and the ones below.
FLOORS = ("base", "parallel", "runfile", "engine", "loop", "above")
FORMAT_MODULE = "hookloop.runfile.format"
#: The edge the rules leave out: the callback base names the loop in its events' types.
ALLOWED_UPWARD = {("hookloop.callback", "hookloop.loop")}
#: Packages that only re-export their modules' public names.
REEXPORTS = {"hookloop", "hookloop.callbacks"}
#: The modules whose job is to put the built-in callbacks in a stack (the built-in
#: presets): their imports of ``hookloop.callbacks.*`` are what a stack names, so the
#: import budget counts the rest of what they import.
STACK_BUILDERS = {"hookloop.presets.builtin"}
#: The modules with budgets of their own (tests/test_size_budget.py):
#: `test_the_run_state_modules_keep_slack_under_their_budgets` checks them.
RUN_STATE_MODULES = {"hookloop.loop", "hookloop.callbacks.checkpoint"}
MAX_LOGIC_LINES = 400
MAX_PROJECT_IMPORTS = 10
MAX_BRANCHES = 20


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def floors_from_docs() -> dict[str, str]:
    """``hookloop/x/y.py`` -> floor, from the table rows of docs/architecture.md."""
    row = re.compile(r"^\|\s*`(hookloop/[\w/]+\.py)`\s*\|\s*(\w+)\s*\|")
    found: dict[str, str] = {}
    for line in ARCHITECTURE.read_text().splitlines():
        match = row.match(line)
        if match:
            path, floor = match.groups()
            found[module_name(ROOT / path)] = floor
    return found


FLOOR = floors_from_docs()


def _resolve(node: ast.ImportFrom | ast.Import, current: str) -> Iterator[str]:
    """The package's modules an import statement names."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                yield name
        return
    if node.level:
        base = current.split(".")
        if not MODULES[current].name == "__init__.py":
            base = base[:-1]
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    for alias in node.names:
        if f"{target}.{alias.name}" in MODULES:
            yield f"{target}.{alias.name}"
        elif target in MODULES:
            yield target


def _imported_names(node: ast.ImportFrom | ast.Import,
                    current: str) -> Iterator[tuple[str, str | None]]:
    """The package's modules an import statement names, each with the name it takes from
    that module (None: the module itself, ``import a.b`` or ``from a import b`` of a
    module ``a.b``)."""
    if isinstance(node, ast.Import):
        for target in _resolve(node, current):
            yield target, None
        return
    for alias in node.names:
        single = ast.ImportFrom(module=node.module, names=[alias], level=node.level)
        for target in _resolve(single, current):
            yield target, None if target.endswith(f".{alias.name}") else alias.name


def _only_reexports(tree: ast.Module) -> bool:
    """A module whose body is only imports and ``__all__`` (its docstring aside)."""
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        if not targets or not all(isinstance(t, ast.Name) and t.id == "__all__"
                                  for t in targets):
            return False
    return True


#: The modules whose names are defined elsewhere: the packages that re-export, and every
#: module that holds nothing but imports (and ``__all__``).
REEXPORTERS = REEXPORTS | {name for name, tree in TREES.items() if _only_reexports(tree)}


def defining_modules(reexporter: str, name: str) -> set[str]:
    """The module that defines ``name``, as ``reexporter`` imports it (through further
    re-exporters); ``reexporter`` itself when it defines the name or binds it otherwise."""
    for node in ast.walk(TREES[reexporter]):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for alias in node.names:
            bound = alias.asname or (alias.name.partition(".")[0]
                                     if isinstance(node, ast.Import) else alias.name)
            if bound != name:
                continue
            single = (ast.Import(names=[alias]) if isinstance(node, ast.Import)
                      else ast.ImportFrom(module=node.module, names=[alias], level=node.level))
            found: set[str] = set()
            for target, imported in _imported_names(single, reexporter):
                if target in REEXPORTERS and imported is not None and target != reexporter:
                    found |= defining_modules(target, imported)
                else:
                    found.add(target)
            if found:
                return found
    return {reexporter}


def counted_imports(name: str, trees: dict[str, ast.Module] = TREES) -> set[str]:
    """The package's modules ``name`` imports as its import budget counts them: a name
    taken from a re-exporting module counts as the module that defines it."""
    found: set[str] = set()
    for node in ast.walk(trees[name]):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target, imported in _imported_names(node, name):
                if target in REEXPORTERS and imported is not None:
                    found |= defining_modules(target, imported)
                else:
                    found.add(target)
    found.discard(name)
    return found


def imports(name: str) -> dict[str, bool]:
    """The package's modules ``name`` imports -> whether only inside a function."""
    found: dict[str, bool] = {}

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _resolve(child, name):
                    if target != name:
                        found[target] = found.get(target, True) and inner
            visit(child, inner)

    visit(TREES[name], False)
    return found


EDGES = {name: imports(name) for name in MODULES}


def test_every_module_is_named_in_docs_architecture_md() -> None:
    assert FLOOR, "docs/architecture.md has no table of modules"
    missing = sorted(set(MODULES) - set(FLOOR))
    assert not missing, f"modules not named in docs/architecture.md: {missing}"
    gone = sorted(set(FLOOR) - set(MODULES))
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"
    unknown = sorted(f"{name}: {floor}" for name, floor in FLOOR.items() if floor not in FLOORS)
    assert not unknown, f"unknown floors (known: {FLOORS}): {unknown}"


def test_docs_architecture_md_is_linked_first_from_the_index() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    links = re.findall(r"\]\(([^)#]+)", index)
    assert links and links[0] == "architecture.md", links[:3]


def test_no_module_imports_a_floor_above_its_own() -> None:
    wrong = []
    for name, targets in EDGES.items():
        for target in targets:
            if (name, target) in ALLOWED_UPWARD or name not in FLOOR or target not in FLOOR:
                continue
            if FLOORS.index(FLOOR[target]) > FLOORS.index(FLOOR[name]):
                wrong.append(f"{name} ({FLOOR[name]}) imports {target} ({FLOOR[target]})")
    assert not wrong, "\n".join(wrong)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph = {name: [t for t in targets if (name, t) not in ALLOWED_UPWARD]
             for name, targets in EDGES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_counting_type_only_and_function_imports() -> None:
    assert _cycles() == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The finder itself, on a made-up graph: the test above can fail."""
    saved = dict(EDGES)
    try:
        EDGES["hookloop.errors"] = {**EDGES["hookloop.errors"], "hookloop.loop": True}
        assert any("hookloop.errors" in c and "hookloop.loop" in c for c in _cycles())
    finally:
        EDGES.clear()
        EDGES.update(saved)


def test_only_modules_above_the_loop_import_it() -> None:
    importers = sorted(name for name, targets in EDGES.items() if "hookloop.loop" in targets
                       and FLOOR.get(name) != "above" and name != "hookloop.callback")
    assert importers == []


def _below_the_loop() -> list[str]:
    """The floors' modules but the callback base: its events take the loop by contract
    (it is what callbacks, above the loop, implement; the floors import it as a type)."""
    return [name for name in MODULES if FLOOR.get(name) in ("base", "parallel", "runfile", "engine")
            and name != "hookloop.callback"]


#: Deprecated public methods below the loop that keep their ``loop`` parameter until
#: their removal (the release is in their warning).
DEPRECATED_LOOP_PARAMETERS = {"hookloop.engine.state.set_batch"}


def test_no_function_below_the_loop_takes_a_loop_parameter() -> None:
    found = []
    for name in _below_the_loop():
        for node in ast.walk(TREES[name]):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(argument.arg == "loop" for argument in arguments):
                    found.append(f"{name}.{getattr(node, 'name', '<lambda>')}")
    assert sorted(set(found) - DEPRECATED_LOOP_PARAMETERS) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_stays_within_400_logic_lines(name: str) -> None:
    assert logic_lines(MODULES[name].read_text()) <= MAX_LOGIC_LINES


def _import_budget(name: str, trees: dict[str, ast.Module] = TREES) -> set[str] | None:
    """What ``name``'s import budget counts (None: exempt): its `counted_imports`, the
    built-in callbacks left out for the module that stacks them."""
    if name == "hookloop.loop" or name in REEXPORTS:
        return None
    counted = counted_imports(name, trees)
    if name in STACK_BUILDERS:
        counted = {target for target in counted if not target.startswith("hookloop.callbacks.")}
    return counted


def test_no_module_imports_more_than_10_of_the_package() -> None:
    wide = {name: len(budget) for name in MODULES
            if (budget := _import_budget(name)) is not None and len(budget) > MAX_PROJECT_IMPORTS}
    assert wide == {}


def test_a_name_imported_through_a_reexporting_module_counts_as_its_defining_module() -> None:
    """The counter itself, on a planted importer: names taken from ``hookloop`` and
    ``hookloop.callbacks`` (and from a package holding only imports) count as the modules
    that define them, so an importer cannot hide its width behind a pass-through."""
    planted = ast.parse(
        "from hookloop import Loop, CheckpointError, __version__\n"
        "from hookloop.callbacks import AMP, EMA, GradClip, Checkpoint\n"
        "import hookloop.callbacks as built_ins\n"
        "def later():\n"
        "    from hookloop.callbacks import Metrics\n"
        "    from hookloop.parallel import ft_plan\n")
    MODULES["hookloop.planted"] = PACKAGE / "planted.py"
    TREES["hookloop.planted"] = planted
    try:
        counted = _import_budget("hookloop.planted")
        statements = imports("hookloop.planted")  # the modules its statements name
        findings = _budgets_at_limit("hookloop.planted", ast.unparse(planted))
    finally:
        del MODULES["hookloop.planted"], TREES["hookloop.planted"]
    assert sorted(statements) == ["hookloop", "hookloop.callbacks", "hookloop.parallel.ft_plan"]
    # Four lines of imports, ten modules: at the budget's limit, which the slack test refuses.
    assert counted is not None and len(counted) == MAX_PROJECT_IMPORTS
    assert [finding.split(" (")[0] for finding in findings] == [
        "hookloop.planted: project imports"]
    assert counted == {"hookloop.loop", "hookloop.errors", "hookloop",
                       "hookloop.callbacks.amp", "hookloop.callbacks.ema",
                       "hookloop.callbacks.grad_clip", "hookloop.callbacks.checkpoint",
                       "hookloop.callbacks", "hookloop.callbacks.metrics",
                       "hookloop.parallel.ft_plan"}
    # The packages of the floors hold only imports: they are found, not listed.
    assert {"hookloop.base", "hookloop.engine", "hookloop.parallel",
            "hookloop.runfile"} <= REEXPORTERS
    assert not _only_reexports(TREES["hookloop.errors"])


def _at_limit(measure: str, value: int, limit: int) -> list[str]:
    return [f"{measure}: {value} (limit {limit}; keep it below)"] if value >= limit else []


def test_every_budget_keeps_slack() -> None:
    """No measure sits at its limit (issue 34, item 5): each is strictly below it, so a
    change that needs one more line, import or branch is not made to move a seam. The run
    state's modules' own budgets (loop.py's lines, ``_train_epoch``, checkpoint.py's lines
    and imports) are the next test's."""
    found = [finding for name, path in MODULES.items()
             for finding in _budgets_at_limit(name, path.read_text())]
    assert not found, "budgets at their limit:\n" + "\n".join(found)


def _budgets_at_limit(name: str, source: str) -> list[str]:
    """The measures of module ``name`` (its ``source``) that reach their limit."""
    found = _at_limit(f"{name}: logic lines", logic_lines(source), MAX_LOGIC_LINES)
    budget = _import_budget(name)
    if budget is not None and name not in RUN_STATE_MODULES:
        found += _at_limit(f"{name}: project imports ({', '.join(sorted(budget))})",
                           len(budget), MAX_PROJECT_IMPORTS)
    for node in ast.walk(TREES[name]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += _at_limit(f"{name}.{node.name}: branches", branches(node), MAX_BRANCHES)
    return found


def test_the_run_state_modules_keep_slack_under_their_budgets() -> None:
    """loop.py, its ``_train_epoch`` and callbacks/checkpoint.py strictly below their own
    budgets (tests/test_size_budget.py) and checkpoint.py below the import budget."""
    loop = MODULES["hookloop.loop"].read_text()
    epoch = function(loop, "_train_epoch")
    checkpoint = MODULES["hookloop.callbacks.checkpoint"]
    budget = _import_budget("hookloop.callbacks.checkpoint") or set()
    found = (_at_limit("hookloop.loop: logic lines", logic_lines(loop), LOOP_LOGIC_LINES)
             + _at_limit("hookloop.loop._train_epoch: logic lines",
                         logic_lines(loop, epoch.lineno, epoch.end_lineno),
                         TRAIN_EPOCH_LOGIC_LINES)
             + _at_limit("hookloop.callbacks.checkpoint: lines",
                         len(checkpoint.read_text().splitlines()), CHECKPOINT_LINES)
             + _at_limit(f"hookloop.callbacks.checkpoint: project imports "
                         f"({', '.join(sorted(budget))})", len(budget), MAX_PROJECT_IMPORTS))
    assert not found, "budgets at their limit:\n" + "\n".join(found)


def branches(function: ast.AST) -> int:
    """Decision points of one function, its nested functions excluded."""
    count = 0
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler,
                             ast.With, ast.AsyncWith, ast.IfExp, ast.match_case, ast.Assert)):
            count += 1
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            count += 1 + len(node.ifs)
        todo.extend(ast.iter_child_nodes(node))
    return count


def test_the_branch_counter_counts() -> None:
    source = ("def f(a, b):\n    if a and b:\n        pass\n    elif a:\n        pass\n"
              "    for x in a:\n        try:\n            pass\n        except E:\n"
              "            pass\n    return [y for y in b if y] or None\n")
    function = ast.parse(source).body[0]
    # if, and, elif, for, except, comprehension + its if, or
    assert branches(function) == 8


def test_no_function_over_20_branches() -> None:
    found = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = branches(node)
                if count > MAX_BRANCHES:
                    found.append(f"{name}.{node.name}: {count}")
    assert found == []


def _string_constants(tree: ast.AST) -> Iterator[ast.Constant]:
    """Every string constant of ``tree`` but docstrings and ``__slots__``' attribute names."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skipped.add(id(body[0].value))
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__slots__"
                for target in node.targets):
            skipped.update(id(item) for item in ast.walk(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in skipped:
            yield node


def _key_constant(module: str, name: str) -> frozenset[str] | None:
    """A module-level tuple or set of ``module`` (its ``KEYS``, ``SHARED_WORDS``), read
    from its source with the names it refers to resolved (nothing imported); None when the
    module defines none."""
    tree = TREES[module]
    strings: dict[str, str] = {}
    for node in tree.body:  # NAME = "key", A, B = "a", "b" and NAME = OTHER = "key"
        if isinstance(node, ast.Assign):
            for target in node.targets:
                value = node.value
                pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(value, ast.Tuple) else [(target, value)])
                for left, right in pairs:
                    if isinstance(left, ast.Name) and isinstance(right, ast.Constant) \
                            and isinstance(right.value, str):
                        strings[left.id] = right.value
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        value = getattr(node, "value", None)
        if value is not None and any(isinstance(t, ast.Name) and t.id == name for t in targets):
            found = {strings[n.id] for n in ast.walk(value)
                     if isinstance(n, ast.Name) and n.id in strings}
            found |= {c.value for c in ast.walk(value)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if name != "KEYS" and any(isinstance(n, ast.Name) and n.id == "KEYS"
                                      for n in ast.walk(value)):
                found |= _key_constant(module, "KEYS") or frozenset()
            return frozenset(found)
    return None


#: The modules that own keys of the run file (each declares its ``KEYS``): the envelope,
#: and the module of each part that writes, checks and reads its own keys.
OWNERS = {name: keys for name in MODULES if (keys := _key_constant(name, "KEYS")) is not None}


def test_each_key_of_the_run_file_is_spelled_in_exactly_one_module_the_part_that_reads_it() -> None:
    """Each key of the file is a constant of exactly one module (its ``KEYS``): the envelope
    (``hookloop/runfile/format.py``: the file's record, the top-level keys) or the module of
    the part that writes, checks and reads it (a class with ``load_state_dict``, or the
    reader of its own entry). No other module spells it; the keys that are also ordinary
    words (each owner's ``SHARED_WORDS``: a device "cuda", a log column "step", torch's
    "params") may appear for their other meaning, except on the run file's own floor, which
    names every key through its owner's constants."""
    assert FORMAT_MODULE in OWNERS and len(OWNERS) >= 5, sorted(OWNERS)
    owner_of: dict[str, str] = {}
    twice = []
    for name, keys in OWNERS.items():
        for key in keys:
            if key in owner_of:
                twice.append(f"{key!r}: {owner_of[key]} and {name}")
            owner_of[key] = name
    assert twice == []
    assert {"model", "optimizer", "save_id", "files", "epoch_samples", "history",
            "ended", "rng", "optimizer_class"} <= set(owner_of)
    shared = frozenset().union(*(_key_constant(name, "SHARED_WORDS") or frozenset()
                                 for name in OWNERS))
    readers = {"load_state_dict", "read_payload", "read_metadata", "resolve", "restore_rng"}
    for name in OWNERS:
        defined = {node.name for node in ast.walk(TREES[name])
                   if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        assert defined & readers, f"{name} owns keys but reads none of them"
    found = []
    for name, tree in TREES.items():
        allowed = frozenset() if FLOOR.get(name) == "runfile" else shared
        own = OWNERS.get(name, frozenset())
        for constant in _string_constants(tree):
            value = constant.value
            if value in owner_of and value not in own and value not in allowed:
                found.append(f"{name}:{constant.lineno}: {value!r} ({owner_of[value]}'s)")
    assert found == []
