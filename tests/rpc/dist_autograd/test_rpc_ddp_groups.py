"""The process group of a DDP module outlives the module's reducer
(``rpc/dist_autograd/_ddp_groups.py``).

torch's reducer must never drop its group's last reference (it does so with the GIL held,
and gloo's threads may need the GIL to finish): the keeper holds the group until the
module, reducer included, is gone, and lets it go only when asked (the agent's monitor,
``shutdown()``). Fakes stand in for the module, its reducer and its group.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from rallypoint.rpc.dist_autograd._ddp_groups import GroupKeeper


class _Group:
    pass


class _Reducer:
    def __init__(self, group: _Group, seen: list[bool]) -> None:
        self._group = weakref.ref(group)  # the real one holds it in C++
        self._seen = seen

    def __del__(self) -> None:
        self._seen.append(self._group() is not None)


class _Module:
    def __init__(self, group: _Group, seen: list[bool]) -> None:
        self.process_group = group
        self.reducer = _Reducer(group, seen)


def _module(seen: list[bool]) -> tuple[_Module, weakref.ref[_Group]]:
    group = _Group()
    return _Module(group, seen), weakref.ref(group)


@pytest.mark.timeout(10)
def test_the_group_outlives_the_reducer_until_it_is_let_go() -> None:
    keeper, seen = GroupKeeper(), []
    module, group = _module(seen)
    keeper.keep(module)
    keeper.keep(module)  # once per module
    del module
    assert seen == [True]  # the reducer went while the group was still held
    assert group() is not None
    keeper.release_due()
    assert group() is None


@pytest.mark.timeout(10)
def test_a_module_in_a_reference_cycle_is_handled_alike() -> None:
    keeper, seen = GroupKeeper(), []
    module, group = _module(seen)
    module.cycle = module  # type: ignore[attr-defined]
    keeper.keep(module)
    del module
    gc.collect()
    assert seen == [True] and group() is not None
    keeper.release_due()
    assert group() is None


@pytest.mark.timeout(10)
def test_shutdown_lets_go_of_the_groups_of_live_modules_too() -> None:
    keeper, seen = GroupKeeper(), []
    module, group = _module(seen)
    gone, gone_group = _module(seen)
    keeper.keep(module)
    keeper.keep(gone)
    del gone
    keeper.release_all()
    assert gone_group() is None
    assert group() is not None  # the module itself still holds it
    del module
    assert group() is None  # nothing kept past release_all


@pytest.mark.timeout(10)
def test_a_module_without_a_process_group_is_not_kept() -> None:
    keeper = GroupKeeper()
    plain: Any = type("Plain", (), {})()
    keeper.keep(plain)
    ref = weakref.ref(plain)
    del plain
    assert ref() is None
    keeper.release_all()
