"""One store protocol (``rallypoint._core.store.Store``) and one door to ``torch._C``
(``rallypoint._core.torch_c``): the source keeps to both, and the stores rallypoint hands
out behave as the protocol says."""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import pytest

import rallypoint

SRC = Path(rallypoint.__file__).parent
ADAPTER = SRC / "_core" / "torch_c.py"


def _modules() -> list[Path]:
    files = sorted(SRC.rglob("*.py"))
    assert ADAPTER in files
    return files


def _names(path: Path) -> str:
    return str(path.relative_to(SRC.parent))


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
        f"{_names(path)}:{line}"
        for path in _modules()
        if path != ADAPTER
        for line in _torch_c_uses(ast.parse(path.read_text()))
    ]
    assert not found, f"torch._C outside {_names(ADAPTER)} (use that module): {found}"
    assert _torch_c_uses(ast.parse(ADAPTER.read_text())), "the adapter itself uses torch._C"


def test_no_store_is_typed_any() -> None:
    found = [
        f"{_names(path)}:{line}"
        for path in _modules()
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


def _memory_store() -> object:
    from rallypoint.rendezvous import MemoryKV

    return MemoryKV().torch_store("p")


def _hash_store() -> object:
    from rallypoint._core.torch_c import HashStore

    return HashStore()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [_hash_store, _memory_store], ids=["HashStore", "MemoryKV"])
def test_stores_do_what_the_protocol_says(make: object) -> None:
    """Every method of the protocol, on torch's in-memory store and on the in-memory fake
    (what tests pass where a store is wanted)."""
    from rallypoint._core.store import Store

    assert callable(make)
    store: Store = make()
    store.set("a", "1")
    store.set("b", b"2")
    assert store.get("a") == b"1" and store.get("b") == b"2"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "x") == b"x"
    assert store.compare_set("c", b"y", b"z") == b"x"  # expected value differs: unchanged
    store.append("log", "a")
    store.append("log", b"b")
    assert store.get("log") == b"ab"
    assert store.check(["a", "b"]) and not store.check(["a", "nope"])
    store.multi_set(["m1", "m2"], ["x", b"y"])
    assert store.multi_get(["m1", "m2"]) == [b"x", b"y"]
    assert store.delete_key("a") and not store.check(["a"])
    store.wait(["b"])
    store.wait(["b"], timedelta(seconds=1))
    store.set_timeout(timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=7)
    with pytest.raises((LookupError, RuntimeError)):
        store.wait(["nope"], timedelta(seconds=0.1))


def test_as_torch_store_refuses_what_torch_cannot_take() -> None:
    from rallypoint._core.torch_c import HashStore, as_torch_store

    store = HashStore()
    assert as_torch_store(store) is store
    with pytest.raises(TypeError, match="c10d Store"):
        as_torch_store(object())  # type: ignore[arg-type]
