"""rpc's subpackages import one way: the transport knows nothing above it, and only the
agent ties the transport, groups, RRefs and distributed autograd together (issue 43)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rallypoint import rpc

RPC = Path(rpc.__file__).parent
ABOVE_TRANSPORT = ("_agent", "_group", "_rref", "dist_autograd", "_api", "_registry")


def _imported(package: str) -> dict[str, set[str]]:
    """Every rallypoint.rpc module each file of ``package`` imports (lazy ones too)."""
    files = sorted((RPC / package).glob("*.py"))
    assert files, f"rallypoint/rpc/{package}/ has no modules"
    found: dict[str, set[str]] = {}
    for path in files:
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[path.name] = {n for n in names if n.startswith("rallypoint.rpc.")}
    return found


def _reaches(imports: dict[str, set[str]], parts: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{file} -> {name}"
        for file, names in imports.items()
        for name in names
        if name.split(".")[2] in parts
    )


def test_transport_imports_nothing_above_it() -> None:
    assert _reaches(_imported("_transport"), ABOVE_TRANSPORT) == []


@pytest.mark.parametrize("package", ["_group", "_rref", "dist_autograd"])
def test_only_the_agent_ties_the_parts_together(package: str) -> None:
    assert _reaches(_imported(package), ("_agent", "_api", "_registry")) == []


def test_worker_info_has_a_module_of_its_own() -> None:
    from rallypoint.rpc._worker_info import WorkerInfo

    assert WorkerInfo is rpc.WorkerInfo
