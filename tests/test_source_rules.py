"""Rules of the repository that a reader checks by eye, checked by the suite: the docs and
the code describe what is, not how it came to be, a private module's docstring says what
it is for in a few lines, a catch-all handler says why, only ``rallypoint._core.torch_c``
touches ``torch._C``, and no store is typed ``Any``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "rallypoint"
ADAPTER = SRC / "_core" / "torch_c.py"
# a private module's docstring: what the module is for, and the key idea before the code
MODULE_DOC_LINES = 12

# an issue of this project, by its number; another project's ("pytorch#130345") is
# a reference a reader can follow
ISSUE = re.compile(r"\bissues?\s+\d+", re.IGNORECASE)
# a calendar date that is not part of a timestamp (a sample screen shows one)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b(?! \d\d:\d\d)")


def _texts() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("src", "tests", "benchmarks", "examples"):
        files += sorted(p for p in (ROOT / folder).rglob("*.py") if ".egg-info" not in str(p))
    return files


def _hits(pattern: re.Pattern[str], files: list[Path]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_nothing_cites_an_issue_of_this_project() -> None:
    assert _hits(ISSUE, _texts()) == []


def test_dates_appear_only_with_the_benchmark_results() -> None:
    files = [p for p in _texts() if p != ROOT / "docs" / "benchmarks.md"]
    assert _hits(DATE, files) == []


def test_the_rpc_reference_fits_500_lines() -> None:
    assert len((ROOT / "docs" / "rpc.md").read_text().splitlines()) <= 500


def test_a_private_module_says_what_it_is_for_in_a_few_lines() -> None:
    """Detail belongs to the class or function it describes, reference to ``docs/``."""
    long = []
    for path in sorted(SRC.rglob("*.py")):
        if not path.name.startswith("_") or path.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc is not None and len(doc.splitlines()) > MODULE_DOC_LINES:
            long.append(f"{path.relative_to(SRC)} ({len(doc.splitlines())} lines)")
    assert not long, f"module docstrings over {MODULE_DOC_LINES} lines: {long}"


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_a_catch_all_handler_says_why(path: Path) -> None:
    """``except BaseException`` catches Ctrl-C and ``sys.exit()``; each one says why it must
    (a comment on its line or the line above)."""
    lines = path.read_text().splitlines()
    silent = [
        f"{path.relative_to(SRC)}:{i + 1}"
        for i, line in enumerate(lines)
        if re.search(r"except BaseException\b", line)
        and "#" not in line
        and not lines[i - 1].strip().startswith("#")
    ]
    assert silent == []


def _torch_c_uses(tree: ast.AST) -> list[int]:
    """Lines that import ``torch._C`` or read ``torch._C`` (attribute or ``getattr``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hit = any(a.name == "torch._C" or a.name.startswith("torch._C.") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            hit = module == "torch._C" or module.startswith("torch._C.")
            hit |= module == "torch" and any(a.name == "_C" for a in node.names)
        elif isinstance(node, ast.Attribute):
            hit = (
                node.attr == "_C" and isinstance(node.value, ast.Name) and node.value.id == "torch"
            )
        elif isinstance(node, ast.Call):
            args = node.args
            hit = (
                isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and len(args) >= 2
                and isinstance(args[1], ast.Constant)
                and args[1].value == "_C"
            )
        else:
            hit = False
        if hit:
            lines.append(node.lineno)
    return sorted(lines)


def _mentions_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "Any" in node.value:
            return True
    return False


def _target_name(target: ast.expr) -> str:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    return ""


def _any_stores(tree: ast.AST) -> list[int]:
    """Lines that type a store (a variable, attribute, parameter or a function's result,
    by its name) as ``Any``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign):
            if "store" in _target_name(node.target).lower() and _mentions_any(node.annotation):
                lines.append(node.lineno)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            lines += [
                a.lineno for a in args if "store" in a.arg.lower() and _mentions_any(a.annotation)
            ]
            if "store" in node.name.lower() and _mentions_any(node.returns):
                lines.append(node.lineno)
    return sorted(lines)


def test_only_the_adapter_touches_torch_c() -> None:
    found = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        if path != ADAPTER
        for line in _torch_c_uses(ast.parse(path.read_text()))
    ]
    assert not found, f"torch._C outside {ADAPTER.relative_to(SRC)} (use that module): {found}"
    assert _torch_c_uses(ast.parse(ADAPTER.read_text())), "the adapter itself uses torch._C"


def test_no_store_is_typed_any() -> None:
    found = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        for line in _any_stores(ast.parse(path.read_text()))
    ]
    assert not found, f"a store typed Any (use rallypoint._core.store.Store): {found}"


def test_the_rules_catch_what_they_are_for() -> None:
    bad = """
import torch._C._distributed_c10d
from torch._C._distributed_c10d import Store
from torch import _C
f = torch._C.Future
m = getattr(torch, "_C")
"""
    assert _torch_c_uses(ast.parse(bad)) == [2, 3, 4, 5, 6]
    bad_stores = """
store: Any = None
self.stacks_store: dict[str, Any] = {}
def f(store: Any) -> None: ...
def _worker_store() -> Any: ...
fine: Any = 1
def g(options: Any, store: Store) -> Store: ...
"""
    assert _any_stores(ast.parse(bad_stores)) == [2, 3, 4, 5]
