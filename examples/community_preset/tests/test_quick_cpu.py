"""The preset's tests, with hookloop's kit (hookloop.testing): run `pytest tests` after
`pip install -e .` (the entry point must be installed for presets.get to find it)."""

from __future__ import annotations

from hookloop import presets
import hookloop
from hookloop.base.versions import satisfies
from hookloop.testing import check_callback, check_preset

from hookloop_quick_cpu import quick_cpu


def test_this_hookloop_is_in_the_declared_range() -> None:
    assert satisfies(hookloop.__version__, quick_cpu.requires)


def test_the_installed_preset_passes_the_kit() -> None:
    # dispatch, declarations, state through a checkpoint file, exact resume
    check_preset("quick_cpu")


def test_the_stack_with_other_arguments_passes_the_kit(tmp_path) -> None:
    check_callback(lambda: quick_cpu(clip=None, warmup=2), tmp_path)


def test_it_is_listed_with_its_description() -> None:
    assert presets.available()["quick_cpu"].startswith("Full precision, clipping")
