"""hookloop.presets.registry: a package's module is imported only when its preset is asked for.

Every package here is a real installed distribution (a ``*.dist-info`` with an
``entry_points.txt`` next to its module, in a directory put on ``sys.path``), found by
``importlib.metadata`` as pip-installed ones are. What a package's import does (sleep,
``sys.exit``, write a marker file) is the observable: a test reads the clock, the exit
status of a child process, or whether the marker exists.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hookloop import ConfigurationError, presets
from hookloop.callbacks import AMP, GradClip

from conftest import ROOT, console_script, subprocess_env

QUIET = {"tensorboard": None, "progress": False, "checkpoint_dir": None}


def install(root: Path, name: str, published: dict[str, str], modules: dict[str, str]) -> None:
    """Lay out a distribution in ``root`` as pip does: its modules and its dist-info."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[hookloop.presets]\n" + "".join(f"{key} = {value}\n" for key, value in published.items()))
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)


def _preset_module(prelude: str) -> str:
    """A preset module whose import first runs ``prelude``."""
    return prelude + '''
from hookloop.callbacks import GradClip

def preset(max_norm=0.3):
    """Clip at 0.3."""
    return [GradClip(max_norm)]
'''


@pytest.fixture
def forget_modules():
    """Imported test modules leave ``sys.modules`` after the test (their names are unique)."""
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


# ------------------------------------------------------------------ a slow import
def test_a_built_in_name_never_waits_for_a_slow_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forget_modules: list[str]) -> None:
    """Item 14: a package taking 10 s to import made ``get("standard")`` take 10 s."""
    install(tmp_path, "slow-presets", {"slow": "hl_registry_slow:preset"},
            {"hl_registry_slow": _preset_module("import time\ntime.sleep(10)\n")})
    install(tmp_path, "quick-presets", {"quick": "hl_registry_quick:preset"},
            {"hl_registry_quick": _preset_module("")})
    forget_modules += ["hl_registry_slow", "hl_registry_quick"]
    monkeypatch.syspath_prepend(str(tmp_path))

    # What is asserted is what is imported, not how long it took: a built-in name imports
    # no other package, and another package's preset, by name, imports that package only.
    assert type(presets.get("standard", **QUIET)[0]) is AMP
    assert type(presets.get("finetune", **QUIET)[0]) is AMP
    presets.get("debug", summary=False, profile=False)
    assert "hl_registry_slow" not in sys.modules and "hl_registry_quick" not in sys.modules
    callbacks = presets.get("quick", max_norm=0.2)

    assert [type(callback) for callback in callbacks] == [GradClip]
    assert callbacks[0].max_norm == 0.2
    assert "hl_registry_slow" not in sys.modules and "hl_registry_quick" in sys.modules


def test_a_clash_is_reported_by_package_without_importing_either(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forget_modules: list[str]) -> None:
    marker = tmp_path / "imported"
    side_effect = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    install(tmp_path / "site", "first-presets", {"twin": "hl_registry_first:preset"},
            {"hl_registry_first": _preset_module(side_effect)})
    install(tmp_path / "site", "second-presets", {"twin": "hl_registry_second:preset",
                                                  "standard": "hl_registry_second:preset"},
            {"hl_registry_second": _preset_module(side_effect)})
    forget_modules += ["hl_registry_first", "hl_registry_second"]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))

    with pytest.raises(ConfigurationError) as caught:
        presets.get("twin")
    message = str(caught.value)
    assert "first-presets 1.0" in message and "second-presets 1.0" in message
    assert "none of them is used" in message
    assert type(presets.get("standard", **QUIET)[0]) is AMP  # the built-in keeps its name
    assert not marker.exists(), marker.read_text()


def test_a_keyboard_interrupt_during_an_import_still_interrupts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forget_modules: list[str]) -> None:
    install(tmp_path, "interrupted-presets", {"interrupted": "hl_registry_interrupted:preset"},
            {"hl_registry_interrupted": _preset_module("raise KeyboardInterrupt\n")})
    forget_modules.append("hl_registry_interrupted")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        presets.get("interrupted")


# ------------------------------------------------------------------ sys.exit at import
EXITING = _preset_module("import sys\nsys.exit(3)\n")

CALLER = '''
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
from hookloop import ConfigurationError, presets

report = {"standard": [type(c).__name__ for c in presets.get(
    "standard", tensorboard=None, progress=False, checkpoint_dir=None)]}
try:
    presets.get("theirs")
except ConfigurationError as error:
    report["theirs"] = str(error)
    report["cause"] = type(error.__cause__).__name__
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report["listed"] = sorted(presets.available())
report["warnings"] = [str(warning.message) for warning in caught]
print(json.dumps(report))
'''


@pytest.mark.slow
def test_a_package_calling_sys_exit_at_import_ends_nothing(tmp_path: Path) -> None:
    """Item 14: a package calling ``sys.exit(3)`` at import ended the caller's script with
    status 3, silently, at ``get("standard")``."""
    site = tmp_path / "site"
    install(site, "exiting-presets", {"theirs": "hl_registry_exiting:preset"},
            {"hl_registry_exiting": EXITING})
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    result = subprocess.run([sys.executable, str(script), str(site)], env=subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.splitlines()[-1])

    assert report["standard"][0] == "AMP"
    assert "'theirs' from exiting-presets 1.0 cannot be used" in report["theirs"]
    assert "SystemExit: 3" in report["theirs"] and report["cause"] == "SystemExit"
    assert "theirs" not in report["listed"] and "standard" in report["listed"]
    assert any("'theirs' from exiting-presets 1.0" in message and "SystemExit" in message
               for message in report["warnings"]), report["warnings"]


@pytest.mark.slow
def test_the_presets_command_lists_a_package_that_exits_at_import(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install(site, "exiting-presets", {"theirs": "hl_registry_exiting:preset"},
            {"hl_registry_exiting": EXITING})
    command = console_script()
    env = subprocess_env()
    env["PYTHONPATH"] = str(site) + ":" + env["PYTHONPATH"]
    result = subprocess.run([command, "presets"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("theirs"))
    assert "exiting-presets 1.0" in row and "not usable" in row and "SystemExit: 3" in row
    assert any(line.startswith("standard ") for line in result.stdout.splitlines())


def test_the_registry_is_what_presets_re_exports() -> None:
    from hookloop.presets import registry

    assert presets.get is registry.get and presets.available is registry.available
    assert presets.ENTRY_POINT_GROUP == registry.ENTRY_POINT_GROUP == "hookloop.presets"


# ------------------------------------------------------------------ other installed packages
DUMMY = '''
from hookloop.callbacks import GradClip

def aaa(max_norm=1.0):
    """A third-party preset whose name sorts before every built-in."""
    return [GradClip(max_norm)]
'''


@pytest.mark.slow
def test_the_presets_tests_pass_with_a_third_party_preset_installed(tmp_path: Path) -> None:
    """Issue 19 item 11: the presets tests failed once any package published a preset
    (they expected the exact list of available presets). Here one is installed for the
    child pytest (on its PYTHONPATH, so the `hookloop` command it starts sees it too)."""
    site = tmp_path / "site"
    install(site, "someone-elses-presets", {"aaa": "hl_registry_dummy:aaa",
                                            "extra": "hl_registry_dummy:aaa"},
            {"hl_registry_dummy": DUMMY})
    env = subprocess_env()
    env["PYTHONPATH"] = str(site) + ":" + env["PYTHONPATH"]
    seen = subprocess.run([sys.executable, "-c", "from hookloop import presets; "
                           "print(sorted(presets.available()))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert "'aaa'" in seen.stdout and "'extra'" in seen.stdout, seen.stdout + seen.stderr
    selected = ("available or get_builds or installed_presets or presets_lists or "
                "describe_reports")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selected,
         "tests/presets/test_presets.py", "tests/test_cli.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = int(result.stdout.rsplit(" passed", 1)[0].split()[-1])
    assert passed >= 5, result.stdout[-2000:]


# ------------------------------------------------------------------ version ranges
RANGED = '''
from hookloop.callbacks import GradClip
from hookloop.presets import requires

@requires(">=0.1,<99")
def fits(max_norm=0.3):
    """Clip at 0.3, for any hookloop 0.x."""
    return [GradClip(max_norm)]

def future(max_norm=0.3):
    """Clip, for hookloop 99."""
    return [GradClip(max_norm)]
future.requires = ">=99.0"
'''


@pytest.mark.slow
def test_a_preset_outside_its_hookloop_range_is_refused_naming_both_versions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forget_modules) -> None:
    import hookloop

    install(tmp_path, "ranged-presets", {"ranged_fits": "hl_test_ranged:fits",
                                         "ranged_future": "hl_test_ranged:future"},
            {"hl_test_ranged": RANGED})
    monkeypatch.syspath_prepend(str(tmp_path))
    forget_modules.append("hl_test_ranged")
    assert [type(callback) for callback in presets.get("ranged_fits")] == [GradClip]
    with pytest.raises(ConfigurationError) as refused:
        presets.get("ranged_future")
    message = str(refused.value)
    assert "'ranged_future' from ranged-presets 1.0" in message
    assert ">=99.0" in message and f"hookloop {hookloop.__version__}" in message
    with pytest.warns(RuntimeWarning, match="ranged_future.*>=99.0"):
        listed = presets.available()
    assert "ranged_fits" in listed and "ranged_future" not in listed

    env = subprocess_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    table = subprocess.run([console_script(), "presets"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    lines = {line.split()[0]: line for line in table.stdout.splitlines() if line.strip()}
    assert "Clip at 0.3" in lines["ranged_fits"] and "[hookloop >=0.1,<99]" in lines["ranged_fits"]
    assert "not usable" in lines["ranged_future"] and "[hookloop >=99.0]" in lines["ranged_future"]
    assert "[hookloop" not in lines["standard"]


@pytest.mark.parametrize(("version", "spec", "inside"), [
    ("0.1.0", ">=0.1", True), ("0.1.0", ">0.1", False), ("0.1.0", "<0.1.1", True),
    ("0.1.0", "==0.1", True), ("0.1.0", "==0.1.*", True), ("0.2.0", "==0.1.*", False),
    ("0.1.5", "~=0.1.2", True), ("0.2.0", "~=0.1.2", False), ("1.4", "~=1.2", True),
    ("0.1.0", "!=0.1.0", False), ("0.1.0", ">=0.1, <0.3, !=0.2.*", True),
    ("0.10.0", "<0.9", False), ("1.0rc1", ">=1.0", True)])
def test_version_ranges_read_as_pep_440_says(version: str, spec: str, inside: bool) -> None:
    from hookloop.base.versions import satisfies

    assert satisfies(version, spec) is inside


@pytest.mark.parametrize("spec", ["0.1", ">=", ">=0.1;<2", ">=0.*", "", "latest"])
def test_a_range_that_cannot_be_read_is_an_error_when_declared(spec: str) -> None:
    with pytest.raises(ConfigurationError, match="version range|clause|take"):
        presets.requires(spec)
