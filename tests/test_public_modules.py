"""Public classes and functions report the module users import them from (as trio's do).

``RendezvousError.__module__`` is ``"rallypoint.rendezvous"``, not the private module that
defines it, so tracebacks and reprs name the documented place, and pickles refer to it.
"""

from __future__ import annotations

import importlib
import inspect
import pickle

import pytest

PARTS = ["distributed", "join", "rendezvous", "testing"]


def _public_objects(part: str) -> list[tuple[str, object]]:
    module = importlib.import_module(f"rallypoint.{part}")
    objects = [(name, getattr(module, name)) for name in module.__all__]
    return [(n, o) for n, o in objects if inspect.isclass(o) or inspect.isfunction(o)]


@pytest.mark.parametrize("part", PARTS)
def test_classes_and_functions_report_their_public_module(part: str) -> None:
    objects = _public_objects(part)
    assert objects, part
    wrong = {
        name: obj.__module__ for name, obj in objects if obj.__module__ != f"rallypoint.{part}"
    }  # type: ignore[attr-defined]
    assert wrong == {}, f"rallypoint.{part}: {wrong}"


def test_examples_of_the_issue() -> None:
    from rallypoint.distributed import DistributedConfig, init_process_group
    from rallypoint.join import Join, RankFailedError
    from rallypoint.rendezvous import RendezvousError, get_rendezvous_handler
    from rallypoint.testing import WorkerError, run_workers

    assert RendezvousError.__module__ == "rallypoint.rendezvous"
    assert get_rendezvous_handler.__module__ == "rallypoint.rendezvous"
    assert Join.__module__ == RankFailedError.__module__ == "rallypoint.join"
    assert DistributedConfig.__module__ == init_process_group.__module__ == "rallypoint.distributed"
    assert WorkerError.__module__ == run_workers.__module__ == "rallypoint.testing"
    assert repr(RendezvousError("x")) == "RendezvousError('x')"


def test_public_errors_pickle_by_their_public_name() -> None:
    from rallypoint.join import RankFailedError
    from rallypoint.rendezvous import RendezvousTimeoutError

    assert b"rallypoint.rendezvous._" not in pickle.dumps(RendezvousTimeoutError)
    again = pickle.loads(pickle.dumps(RendezvousTimeoutError("too slow")))
    assert type(again) is RendezvousTimeoutError and str(again) == "too slow"
    failed = pickle.loads(pickle.dumps(RankFailedError(1, "boom", 0)))
    assert type(failed) is RankFailedError
