"""The public surface: what `import rallypoint` and its parts offer, and that it stays cheap."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import rallypoint

PARTS = sorted(  # every public subpackage, found on disk (the face's own list is checked)
    p.name
    for p in Path(rallypoint.__file__).parent.iterdir()
    if p.is_dir() and not p.name.startswith("_") and (p / "__init__.py").exists()
)
"""Every public part: each is checked by every test below."""
TORCHS_OWN = {("rpc", "TensorPipeRpcBackendOptions")}
"""torch's own classes re-exported as they are (torch compatibility): their home is torch."""


def test_the_face_lists_every_public_part() -> None:
    assert rallypoint._PARTS == PARTS  # type: ignore[attr-defined]


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
    parts = ("launcher", "_launch", "_supervise", "_elastic", "_cli", "_watch", "_worker_side")
    assert {m for m in loaded if m.split(".")[1] in parts} == {"rallypoint.launcher"}


def test_worker_summary_and_statuses_and_the_deprecated_name() -> None:
    from rallypoint import launcher

    assert launcher.WorkerStatus.TERMINATED == "terminated"  # the events' and screens' word
    assert launcher.JobStatus.INTERRUPTED == "interrupted"
    with pytest.warns(DeprecationWarning, match="WorkerState is deprecated: it is WorkerSummary"):
        old = launcher.WorkerState
    assert old is launcher.WorkerSummary


FACES = ["rallypoint"] + [f"rallypoint.{part}" for part in PARTS]
LAZY = ["rallypoint", "rallypoint.distributed", "rallypoint.launcher", "rallypoint.observe"]
LAZY += ["rallypoint.snapshot", "rallypoint.testing"]
"""The faces whose import must stay cheap: each name is imported on first access."""
PLUMBING = ("typing", "rallypoint._core.public", "rallypoint._core.version")
"""What a face imports besides its names (``__version__`` is the package's own)."""
INTERNAL = [
    "rallypoint._cli",
    "rallypoint._core",
    "rallypoint._elastic",
    "rallypoint._elastic._health",
    "rallypoint._launch",
    "rallypoint._snapshot",
    "rallypoint._supervise",
    "rallypoint._supervise._inprocess",
    "rallypoint._supervise._warm",
    "rallypoint._watch",
    "rallypoint._watch._flight",
    "rallypoint._watch._stragglers",
    "rallypoint._worker_side",
]


def _source(name: str) -> list[ast.stmt]:
    module = importlib.import_module(name)
    with open(module.__file__ or "", encoding="utf-8") as file:
        return ast.parse(file.read()).body


def _reexports(body: list[ast.stmt]) -> dict[str, str]:
    """``{name: module}`` of a face's ``from module import name as name`` lines: at the top
    (an eager face) or in its ``if TYPE_CHECKING:`` block (a lazy one: what mypy reads)."""
    lines: list[ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            lines += [line for line in node.body if isinstance(line, ast.ImportFrom)]
            assert len(lines) == len(node.body), f"imports only: {ast.unparse(node)}"
        elif isinstance(node, ast.ImportFrom) and node.module not in PLUMBING:
            lines.append(node)
    table = {}
    for line in lines:
        for alias in line.names:
            assert alias.asname == alias.name, f"re-exported as itself: {ast.unparse(line)}"
            table[alias.name] = line.module or ""
    return table


def _literal(body: list[ast.stmt], target: str) -> object:
    values = [
        ast.literal_eval(node.value)
        for node in body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == target
    ]
    assert len(values) == 1, f"{target} is assigned once, a literal: {len(values)}"
    return values[0]


@pytest.mark.parametrize("name", FACES)
def test_every_face_lists_its_table_and_nothing_else(name: str) -> None:
    """``__all__`` is the face's re-exports, ``dir()`` shows exactly it (and dunders), every
    name resolves, and nothing else does: no hidden names for other parts."""
    module = importlib.import_module(name)
    table = _reexports(_source(name))
    assert sorted(module.__all__) == sorted(n for n in table if not n.startswith("_"))
    paths = [  # a face's public submodules are module paths of its own (torchft's in ft)
        n for n in dir(module) if getattr(getattr(module, n), "__name__", "") == f"{name}.{n}"
    ]
    shown = [n for n in dir(module) if not n.startswith("_")]
    assert [n for n in shown if n in module.__all__ or n not in paths] == sorted(module.__all__)
    for entry in table:
        assert getattr(module, entry) is not None, f"{name}.{entry}"
    for hidden in ("run_job", "Observer", "serve", "set_public_module", "import_module"):
        assert hidden not in table
        if hidden not in vars(module):
            with pytest.raises(AttributeError):
                getattr(module, hidden)


@pytest.mark.parametrize("name", FACES)
def test_every_face_is_plain_python(name: str) -> None:
    """A face reads no file at import (bytecode-only and zip installs work): ``__all__`` is a
    literal; an eager face imports its names; a lazy one keeps them for mypy in
    ``if TYPE_CHECKING:`` and maps each to its module in ``_HOMES`` for the PEP 562
    ``__getattr__`` and ``__dir__`` of one class (``_core.public.LazyFace``, which
    ``lazy_face`` makes the module's): no face defines them, and mypy, which does not see
    them, keeps an unknown name an error."""
    body = _source(name)
    source = "\n".join(ast.unparse(node) for node in body)
    for banned in ("open(", "__file__", "read_text", "_core.face", "TYPE_CHECKING_"):
        assert banned not in source, f"{name}: {banned}"
    exported = _literal(body, "__all__")
    assert isinstance(exported, list) and all(isinstance(n, str) for n in exported), name
    table = _reexports(body)
    lazy = any(isinstance(node, ast.If) for node in body)
    assert lazy == (name in LAZY), name
    if not lazy:
        assert "set_public_module(__name__, globals(), __all__)" in source, name
        return
    homes = _literal(body, "_HOMES")
    parts = _literal(body, "_PARTS") if "_PARTS" in source else []
    assert isinstance(homes, dict) and isinstance(parts, list), name
    assert sorted([*homes, *parts]) == sorted(table), name
    assert all(table[part] == name for part in parts), name  # its subpackages
    for entry, home in homes.items():
        assert table[entry] == home, f"{name}.{entry}: {home} here, {table[entry]} for mypy"
    tests = [ast.unparse(node.test) for node in body if isinstance(node, ast.If)]
    assert tests == ["TYPE_CHECKING"], name
    assert "lazy_face(__name__)" in source, name
    defined = {
        t.id
        for n in body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert not defined & {"__getattr__", "__dir__"}, f"{name}: its own __getattr__/__dir__"
    module = importlib.import_module(name)
    assert type(module).__name__ == "LazyFace", name
    assert not any(isinstance(n, ast.FunctionDef) for n in body), f"{name}: no own functions"


@pytest.mark.parametrize("name", INTERNAL)
def test_internal_packages_are_a_docstring(name: str) -> None:
    """Their modules are imported directly: an internal package re-exports nothing."""
    module = importlib.import_module(name)
    with open(module.__file__ or "", encoding="utf-8") as file:
        body = ast.parse(file.read()).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr), name
