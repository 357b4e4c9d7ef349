"""The public surface: what `import rallypoint` and its parts offer, and that it stays cheap."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import rallypoint

PARTS = ["distributed", "join", "launcher", "rendezvous", "rpc", "testing"]


def test_top_level_names_resolve() -> None:
    for name in rallypoint.__all__:
        assert getattr(rallypoint, name) is not None, name


@pytest.mark.parametrize("part", PARTS)
def test_each_part_exports_what_it_lists(part: str) -> None:
    module = importlib.import_module(f"rallypoint.{part}")
    assert module.__all__, part
    assert len(set(module.__all__)) == len(module.__all__), f"duplicates in {part}.__all__"
    for name in module.__all__:
        assert getattr(module, name) is not None, f"rallypoint.{part}.{name}"


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = rallypoint.nope  # type: ignore[attr-defined]
    testing = importlib.import_module("rallypoint.testing")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = testing.nope


def test_launch_and_progress_are_the_launcher_functions() -> None:
    from rallypoint import launcher

    assert rallypoint.launch is launcher.launch
    assert rallypoint.LaunchConfig is launcher.LaunchConfig
    assert rallypoint.progress is launcher.progress
    rallypoint.progress()  # outside a launch: a cheap no-op, never an error


@pytest.mark.parametrize(
    "statement",
    ["import rallypoint", "import rallypoint.testing", "import rallypoint.launcher"],
)
def test_import_does_not_load_torch(statement: str) -> None:
    code = f"import sys; {statement}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
