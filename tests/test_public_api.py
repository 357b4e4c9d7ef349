"""The public surface: what `import rallypoint` and its parts offer, and that it stays cheap."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys

import pytest

import rallypoint

PARTS = ["distributed", "join", "launcher", "observe", "rendezvous", "rpc", "snapshot", "testing"]
"""Every public part: each is checked by every test below."""
TORCHS_OWN = {("rpc", "TensorPipeRpcBackendOptions")}
"""torch's own classes re-exported as they are (torch compatibility): their home is torch."""


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


@pytest.mark.parametrize("part", PARTS)
def test_public_names_report_their_public_module(part: str) -> None:
    """As trio does: ``repr``, tracebacks and pickles name the module users import (the
    part itself, or the public module that documents a re-exported name), never a private
    one."""
    module = importlib.import_module(f"rallypoint.{part}")
    for name in module.__all__:
        obj = getattr(module, name)
        public = inspect.isclass(obj) or inspect.isfunction(obj) or hasattr(obj, "__wrapped__")
        if not public or (part, name) in TORCHS_OWN:
            continue  # a value, a typing alias (RendezvousHandlerCreator), or torch's own
        home = obj.__module__
        assert not any(p.startswith("_") for p in home.split(".")), f"{part}.{name}: {home}"
        assert getattr(importlib.import_module(home), name) is obj, f"{part}.{name}: {home}"


def test_launch_names_live_in_rallypoint_launcher() -> None:
    from rallypoint import launcher

    for obj in (launcher.WorkerFailedError, launcher.LaunchConfig, launcher.launch):
        assert obj.__module__ == "rallypoint.launcher"
    assert rallypoint.WorkerFailedError.__module__ == "rallypoint.launcher"
    assert rallypoint.progress.__module__ == "rallypoint.observe"
    assert launcher.EventLog.__module__ == "rallypoint.observe"
    assert repr(launcher.WarmErrorKind.PRELOAD).startswith("<WarmErrorKind.PRELOAD")


@pytest.mark.parametrize(
    "statement",
    [
        "import rallypoint",
        "import rallypoint.testing",
        "import rallypoint.launcher",
        "import rallypoint.observe",
        "from rallypoint import snapshot",
    ],
)
def test_import_does_not_load_torch(statement: str) -> None:
    code = f"import sys; {statement}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_progress_from_the_launcher_loads_only_progress() -> None:
    """Training scripts import it in every worker: it must not pull in the launcher."""
    code = (
        "import sys; from rallypoint.launcher import progress; progress(); "
        "print(sorted(m for m in sys.modules if m.startswith('rallypoint.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = set(ast.literal_eval(out.stdout))
    assert "rallypoint.observe._progress" in loaded
    parts = ("launcher", "supervise", "elastic", "cli")
    assert {m for m in loaded if m.split(".")[1] in parts} == {"rallypoint.launcher"}


def test_worker_summary_and_statuses_and_the_deprecated_name() -> None:
    from rallypoint import launcher

    assert launcher.WorkerStatus.TERMINATED == "terminated"  # the events' and screens' word
    assert launcher.JobStatus.INTERRUPTED == "interrupted"
    with pytest.warns(DeprecationWarning, match="WorkerState is deprecated: it is WorkerSummary"):
        old = launcher.WorkerState
    assert old is launcher.WorkerSummary
