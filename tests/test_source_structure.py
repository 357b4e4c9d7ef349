"""The structure rules of ``docs/architecture.md``, checked from the source (nothing is
imported): no import cycle between modules, no module over 600 lines, no function over 80,
and no package whose own modules (the ``.py`` files directly in it) pass 3,500 lines."""

from __future__ import annotations

import ast
import functools
import graphlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "rallypoint"
MODULE_LINES = 600
FUNCTION_LINES = 80
PACKAGE_LINES = 3_500


@dataclass(frozen=True)
class Module:
    name: str
    """Dotted: ``rallypoint._supervise._attempt``; a package is its ``__init__``."""
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def read_modules(top: Path) -> dict[str, Module]:
    """Every module of the package in directory ``top``, by dotted name."""
    found = {}
    for path in sorted(top.rglob("*.py")):
        parts = [top.name, *path.relative_to(top).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        found[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements under ``node`` that run (in functions too), leaving out the
    body of ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [node]
    if isinstance(node, ast.If) and _type_checking_only(node):
        children: list[ast.AST] = list(node.orelse)
    else:
        children = list(ast.iter_child_nodes(node))
    return [found for child in children for found in _import_nodes(child)]


def imported(module: Module, known: dict[str, Module]) -> set[str]:
    """The modules among ``known`` that ``module`` imports when it runs. ``from X import
    Y`` imports the module ``X.Y`` when there is one, else ``X``; a package's ``__init__``
    importing its own modules (to re-export them) is no edge."""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    targets = set()
    for node in _import_nodes(module.tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    own = module.name + "." if module.is_package else None
    return {
        t for t in targets if t in known and t != module.name and not (own and t.startswith(own))
    }


def import_cycle(modules: dict[str, Module]) -> list[str]:
    """One import cycle among ``modules`` (its first module again at its end), or ``[]``."""
    graph = {name: imported(module, modules) for name, module in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return []


@functools.cache
def _ours() -> dict[str, Module]:
    return read_modules(SRC)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_import_cycle() -> None:
    cycle = import_cycle(_ours())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_module_over_600_lines() -> None:
    long = {m.name: n for m in _ours().values() if (n := _lines(m.path)) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines (two concepts share each): {long}"


def test_no_function_over_80_lines() -> None:
    long = {
        f"{m.name}:{node.lineno} {node.name}": length
        for m in _ours().values()
        for node in ast.walk(m.tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > FUNCTION_LINES
    }
    assert not long, f"functions over {FUNCTION_LINES} lines (a state machine wants names): {long}"


def test_no_package_whose_own_modules_pass_3500_lines() -> None:
    """A subpackage's lines are its own, not its parent's."""
    big = {}
    for init in sorted(SRC.rglob("__init__.py")):
        total = sum(_lines(path) for path in init.parent.glob("*.py"))
        if total > PACKAGE_LINES:
            big[str(init.parent.relative_to(SRC.parent))] = total
    assert not big, f"packages whose own modules pass {PACKAGE_LINES} lines: {big}"


# ---------------------------------------------------------------------- the checker itself
def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    top = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
    return read_modules(top)


def test_the_checker_finds_a_cycle_through_relative_and_function_imports(
    tmp_path: Path,
) -> None:
    modules = _package(
        tmp_path,
        {
            "sub/__init__.py": "",
            "sub/a.py": "from ..b import thing\n",
            "b.py": "def thing():\n    from pkg.sub import a\n",
        },
    )
    assert import_cycle(modules) in (
        ["pkg.sub.a", "pkg.b", "pkg.sub.a"],
        ["pkg.b", "pkg.sub.a", "pkg.b"],
    )


def test_the_checker_leaves_out_type_checking_imports_and_a_package_s_own(
    tmp_path: Path,
) -> None:
    modules = _package(
        tmp_path,
        {
            "__init__.py": "from pkg.a import A as A\n",
            "a.py": "from typing import TYPE_CHECKING\nimport pkg\n"
            "if TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n",
            "b.py": "from pkg.a import A\nB = A\n",
        },
    )
    assert imported(modules["pkg.a"], modules) == {"pkg"}
    assert imported(modules["pkg"], modules) == set()
    assert import_cycle(modules) == []
