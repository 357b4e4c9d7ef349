"""Public classes and functions report the module users import them from (as trio's do):
examples, pickles and the lazy attributes behind it. Every part's names are checked by
``test_public_api.py::test_public_names_report_their_public_module``.

``RendezvousError.__module__`` is ``"rallypoint.rendezvous"``, not the private module that
defines it, so tracebacks and reprs name the documented place, and pickles refer to it.
"""

from __future__ import annotations

import pickle

import pytest


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


def test_lazy_attributes_import_on_first_use_and_cache() -> None:
    from rallypoint._core import lazy_attributes

    namespace: dict[str, object] = {"__all__": ["check_int", "Closing"]}
    getattr_, dir_ = lazy_attributes(
        "rallypoint._core",
        namespace,
        {"check_int": "rallypoint._core.checks", "Closing": "rallypoint._core.closing"},
        submodules=["net"],
    )
    from rallypoint._core.checks import check_int

    assert getattr_("check_int") is check_int
    assert namespace["check_int"] is check_int  # cached: __getattr__ runs once per name
    assert getattr_("net").__name__ == "rallypoint._core.net"
    assert "net" not in namespace  # a submodule is not a public attribute
    assert dir_() == ["Closing", "__all__", "check_int"]
    with pytest.raises(AttributeError, match=r"module 'rallypoint\._core' has no attribute 'x'"):
        getattr_("x")


def test_internal_lazy_names_resolve_but_stay_out_of_dir() -> None:
    """A public package's face may offer its siblings an internal name: it resolves, but
    ``dir()`` (the public surface) never lists it and its ``__module__`` stays private."""
    from rallypoint._core import lazy_attributes
    from rallypoint._core.checks import check_int

    namespace: dict[str, object] = {"__all__": ["Closing"]}
    getattr_, dir_ = lazy_attributes(
        "rallypoint._core",
        namespace,
        {"Closing": "rallypoint._core.closing"},
        public_home=True,
        internal={"check_int": "rallypoint._core.checks"},
    )
    assert getattr_("check_int") is check_int
    assert check_int.__module__ == "rallypoint._core.checks"
    assert "check_int" not in dir_() and "check_int" not in namespace
    assert dir_() == ["Closing", "__all__"]


def test_faces_of_public_parts_keep_internal_names_out_of_dir() -> None:
    import rallypoint.launcher
    import rallypoint.observe
    import rallypoint.snapshot

    for module, name in [
        (rallypoint.launcher, "run_job"),
        (rallypoint.observe, "Observer"),
        (rallypoint.snapshot, "serve"),
    ]:
        assert getattr(module, name) is not None
        assert name not in dir(module) and name not in module.__all__


def test_set_public_module_leaves_names_defined_elsewhere() -> None:
    import datetime

    from rallypoint._core import set_public_module

    class Local:
        pass

    Local.__module__ = "pkg._private"
    namespace = {"Local": Local, "timedelta": datetime.timedelta, "VALUE": 3}
    set_public_module("pkg", namespace, ["Local", "timedelta", "VALUE", "missing"])
    assert Local.__module__ == "pkg"
    assert datetime.timedelta.__module__ == "datetime"
