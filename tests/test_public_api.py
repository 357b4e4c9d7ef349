"""The public surface: what `import rallypoint` and its parts offer, and that it stays cheap."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys

import pytest

import rallypoint
from rallypoint._core.face import read_table

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
        "import rallypoint; import rallypoint.launcher; import rallypoint.observe",
        "import rallypoint.distributed",
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
    parts = ("launcher", "_launch", "_supervise", "_elastic", "_cli", "_watch")
    assert {m for m in loaded if m.split(".")[1] in parts} == {"rallypoint.launcher"}


def test_worker_summary_and_statuses_and_the_deprecated_name() -> None:
    from rallypoint import launcher

    assert launcher.WorkerStatus.TERMINATED == "terminated"  # the events' and screens' word
    assert launcher.JobStatus.INTERRUPTED == "interrupted"
    with pytest.warns(DeprecationWarning, match="WorkerState is deprecated: it is WorkerSummary"):
        old = launcher.WorkerState
    assert old is launcher.WorkerSummary


FACE_MODULE = "rallypoint._core.face"
FACES = ["rallypoint"] + [f"rallypoint.{part}" for part in PARTS]
INTERNAL = [
    "rallypoint._cli",
    "rallypoint._core",
    "rallypoint._elastic",
    "rallypoint._launch",
    "rallypoint._snapshot",
    "rallypoint._supervise",
    "rallypoint._supervise._inprocess",
    "rallypoint._supervise._warm",
    "rallypoint._watch",
    "rallypoint._watch._flight",
    "rallypoint._watch._stragglers",
]


@pytest.mark.parametrize("name", FACES)
def test_every_face_lists_its_table_and_nothing_else(name: str) -> None:
    """``__all__`` is the face's table, ``dir()`` shows exactly it (and dunders), every name
    resolves, and nothing else does: no hidden names for other parts."""
    module = importlib.import_module(name)
    with open(module.__file__ or "", encoding="utf-8") as file:
        table = read_table(file.read())
    assert module.__all__ == sorted(n for n in table if not n.startswith("_"))
    assert [n for n in dir(module) if not n.startswith("_")] == module.__all__
    for entry in table:
        assert getattr(module, entry) is not None, f"{name}.{entry}"
    for hidden in ("run_job", "Observer", "serve", "lazy_attributes", "TYPE_CHECKING_"):
        assert hidden not in table
        if hidden not in vars(module):
            with pytest.raises(AttributeError):
                getattr(module, hidden)


@pytest.mark.parametrize("name", FACES)
def test_every_face_looks_the_same(name: str) -> None:
    """A docstring, ``TYPE_CHECKING`` and ``face`` imports, one ``if TYPE_CHECKING:`` table
    of ``from module import name as name`` lines, and ``__all__ = face(globals()...)``."""
    module = importlib.import_module(name)
    with open(module.__file__ or "", encoding="utf-8") as file:
        body = ast.parse(file.read()).body
    kinds = []
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            kinds.append("doc")
        elif isinstance(node, ast.ImportFrom) and node.module in (
            "typing",
            "rallypoint._core.face",
        ):
            kinds.append("import")
        elif isinstance(node, ast.ImportFrom) and node.module == "rallypoint._core.version":
            assert name == "rallypoint", name  # the one other line a face may have
            assert [(a.name, a.asname) for a in node.names] == [("__version__",) * 2], name
        elif isinstance(node, ast.If):
            assert ast.unparse(node.test) == "TYPE_CHECKING", name
            assert all(isinstance(n, ast.ImportFrom) for n in node.body), name
            assert all(a.asname for n in node.body for a in n.names), name  # type: ignore[attr-defined]
            kinds.append("table")
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            assert ast.unparse(node.value).startswith("face(globals()"), name
            kinds.append("all")
        else:
            raise AssertionError(f"{name}: {ast.unparse(node)}")
    assert kinds == ["doc", "import", "import", "table", "all"], name


@pytest.mark.parametrize("name", INTERNAL)
def test_internal_packages_are_a_docstring(name: str) -> None:
    """Their modules are imported directly: an internal package re-exports nothing."""
    module = importlib.import_module(name)
    with open(module.__file__ or "", encoding="utf-8") as file:
        body = ast.parse(file.read()).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr), name


def test_the_face_table_reader() -> None:
    source = (
        "x = 1\n"
        "if TYPE_CHECKING:\n"
        "    from pkg._a import A as A  # a comment\n"
        "    # torch's name:\n"
        "# a comment at the margin\n"
        "    from pkg._b import (\n"
        "        B as B,\n"
        "        c as C,\n"
        "    )\n"
        "\n"
        "    from pkg import sub as sub\n"
        "__all__ = face(globals())\n"
    )
    assert read_table(source) == {
        "A": ("pkg._a", "A"),
        "B": ("pkg._b", "B"),
        "C": ("pkg._b", "c"),
        "sub": ("pkg", "sub"),
    }
    with pytest.raises(ImportError, match="name as name"):
        read_table("if TYPE_CHECKING:\n    from pkg._a import A\n")
    with pytest.raises(ImportError, match="imports only"):
        read_table("if TYPE_CHECKING:\n    X = 1\n")
