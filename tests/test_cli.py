"""The `hookloop` console command, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import hookloop
from hookloop.base.events import Event

from conftest import console_script, subprocess_env


def _run(*args: str) -> subprocess.CompletedProcess:
    command = console_script()
    return subprocess.run([command, *args], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())


@pytest.mark.slow
def test_version_prints_hookloop_and_torch_versions() -> None:
    result = _run("version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"hookloop {hookloop.__version__} (torch {torch.__version__})"


@pytest.mark.slow
def test_events_prints_every_event_in_firing_order() -> None:
    result = _run("events")
    assert result.returncode == 0, result.stderr
    positions = [result.stdout.index(event.value) for event in Event]
    assert positions == sorted(positions)


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("nonsense",)])
def test_bad_usage_exits_non_zero_with_usage(args) -> None:
    result = _run(*args)
    assert result.returncode == 2
    assert "usage: hookloop" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args", [("--help",), ("run", "--help"), ("presets", "--help"), ("describe", "--help"),
                                  ("events", "--help"), ("version", "--help")])
def test_help_everywhere(args) -> None:
    result = _run(*args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hookloop")


@pytest.mark.slow
def test_presets_lists_names_packages_and_descriptions() -> None:
    result = _run("presets")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["preset", "package", "description"]
    rows = {line.split()[0]: line for line in lines[1:] if line.strip()}
    for name in ("standard", "finetune", "debug"):
        assert rows[name].split()[1] == "hookloop"
    assert "Mixed precision, clipping, EMA" in rows["standard"]


@pytest.mark.slow
def test_describe_prints_the_event_table_of_a_preset_with_arguments() -> None:
    result = _run("describe", "finetune", "checkpoint_dir=None", "tensorboard=None",
                  "progress=False", "clip=0.5")
    assert result.returncode == 0, result.stderr
    assert "presets.get('finetune', checkpoint_dir=None, tensorboard=None, progress=False, " \
           "clip=0.5)" in result.stdout
    assert "[AMP(dtype=torch.bfloat16, scaler=False), GradClip(max_norm=0.5), LRScheduler(" \
           in result.stdout
    table = result.stdout[result.stdout.index("on_fit_start"):]
    positions = [table.index(event.value[:20]) for event in Event]  # long names are cut
    assert positions == sorted(positions)


@pytest.mark.slow
def test_describe_reports_unknown_presets_and_arguments() -> None:
    result = _run("describe", "standart")
    assert result.returncode == 1
    assert "No preset named 'standart'. Did you mean 'standard'?" in result.stderr
    result = _run("describe", "standard", "emma=0.9")
    assert result.returncode == 1 and "unexpected keyword argument 'emma'" in result.stderr
    result = _run("describe", "standard", "ema")
    assert result.returncode == 2 and "is not key=value" in result.stderr


def test_values_are_python_literals_or_text() -> None:
    from hookloop.cli import parse_assignment

    assert parse_assignment("ema=None") == ("ema", None)
    assert parse_assignment("warmup=0.1") == ("warmup", 0.1)
    assert parse_assignment("amp='fp16'") == ("amp", "fp16")
    assert parse_assignment("amp=fp16") == ("amp", "fp16")
    assert parse_assignment("checkpoint_dir=runs/a b") == ("checkpoint_dir", "runs/a b")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", ["0", "two"])
def test_run_refuses_a_bad_process_count_before_starting_anything(nproc: str) -> None:
    result = _run("run", "--nproc", nproc, "train.py")
    assert result.returncode == 2
    assert "--nproc must be a number of processes" in result.stderr


@pytest.mark.slow
def test_python_dash_m_hookloop_is_the_same_command() -> None:
    import sys

    result = subprocess.run([sys.executable, "-m", "hookloop", "version"], capture_output=True,
                            text=True, timeout=120, env=subprocess_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"hookloop {hookloop.__version__} (torch {torch.__version__})"


@pytest.mark.slow
def test_presets_check_runs_the_kit_on_a_preset() -> None:
    result = _run("presets", "check", "debug", "summary=False", "profile=False", "steps=None")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hookloop presets check debug: every check of hookloop.testing passed" in result.stdout
    missing = _run("presets", "check", "no_such_preset")
    assert missing.returncode == 1 and "No preset named 'no_such_preset'" in missing.stderr


@pytest.mark.slow
def test_usage_error_comes_before_torch_is_imported() -> None:
    """Issue 37 item 6: `hookloop run --nproc two x.py` took 66 s on a cold machine to print
    argparse's error, because torch was imported before the arguments were read. The usage
    line now comes without torch in the process, and within a second as a console script."""
    code = ("import sys\nfrom hookloop.cli import main\ntry:\n    main(['run', '--nproc', 'two', "
            "'x.py'])\nexcept SystemExit as end:\n    print(end.code, 'torch' in sys.modules)")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env=subprocess_env())
    assert probe.stdout.split() == ["2", "False"], probe.stderr
    assert "usage: hookloop run" in probe.stderr and "--nproc" in probe.stderr
    # The wall time of the real command (a second try absorbs a busy machine's hiccup).
    for _ in range(2):
        started = time.perf_counter()
        result = _run("run", "--nproc", "two", "x.py")
        elapsed = time.perf_counter() - started
        if elapsed < 1.0:
            break
    assert result.returncode == 2 and "usage: hookloop run" in result.stderr, result.stderr
    assert elapsed < 1.0, f"the usage error took {elapsed:.2f} s"
