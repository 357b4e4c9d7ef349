"""Public classes and functions report the module users import them from (as trio's do):
examples, pickles and the lazy attributes behind it. Every part's names are checked by
``test_public_api.py::test_public_names_report_their_public_module``.

``RendezvousError.__module__`` is ``"rallypoint.rendezvous"``, not the private module that
defines it, so tracebacks and reprs name the documented place, and pickles refer to it.
"""

from __future__ import annotations

import pickle


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


def test_set_public_module_leaves_names_defined_elsewhere() -> None:
    import datetime

    from rallypoint._core.public import set_public_module

    class Local:
        pass

    class Internal:
        pass

    class Public:
        pass

    Local.__module__ = "pkg._private"
    Internal.__module__ = "pkg._internal._mod"
    Public.__module__ = "pkg.other"
    namespace = {"Local": Local, "timedelta": datetime.timedelta, "VALUE": 3}
    namespace |= {"Internal": Internal, "Public": Public}
    names = ["Local", "Internal", "Public", "timedelta", "VALUE", "missing"]
    set_public_module("pkg.face", namespace, names)
    assert Local.__module__ == Internal.__module__ == "pkg.face"
    assert Public.__module__ == "pkg.other"  # another public module documents it
    assert datetime.timedelta.__module__ == "datetime"
