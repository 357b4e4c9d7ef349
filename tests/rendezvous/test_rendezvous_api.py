"""Drop-in compatibility: the same assertions run against torch's rendezvous API and ours."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch.distributed.elastic.rendezvous as torch_rdzv
import torch.distributed.elastic.rendezvous.utils as torch_utils

import rallypoint.rendezvous as ours

APIS = [pytest.param(torch_rdzv, id="torch"), pytest.param(ours, id="rallypoint")]


@pytest.fixture(params=APIS)
def api(request: pytest.FixtureRequest) -> ModuleType:
    return request.param  # type: ignore[no-any-return]


def _message(fn: Any, *args: Any, **kwargs: Any) -> tuple[type[BaseException], str]:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return type(exc), str(exc)
    raise AssertionError("no exception")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "e", "r", 1, 1), "The rendezvous backend name must be a non-empty string."),
        (
            ("c10d", "e", "r", 0, 1),
            "The minimum number of rendezvous nodes (0) must be greater than zero.",
        ),
        (
            ("c10d", "e", "r", 3, 2),
            "The maximum number of rendezvous nodes (2) must be greater than or equal to the "
            "minimum number of rendezvous nodes (3).",
        ),
    ],
)
def test_parameters_validation(api: ModuleType, args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError) as info:
        api.RendezvousParameters(*args)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True), (False, False), (None, None), (1, True), (0, False),
        ("1", True), ("true", True), ("TRUE", True), ("t", True), ("yes", True), ("Y", True),
        ("0", False), ("false", False), ("F", False), ("no", False), ("n", False),
    ],
)  # fmt: skip
def test_get_as_bool_spellings(api: ModuleType, value: Any, expected: bool | None) -> None:
    params = api.RendezvousParameters("c10d", "e", "r", 1, 1, opt=value)
    assert params.get_as_bool("opt") is expected


@pytest.mark.parametrize("value", ["maybe", 2, "", 1.5, "10"])
def test_get_as_bool_rejects(api: ModuleType, value: Any) -> None:
    params = api.RendezvousParameters("c10d", "e", "r", 1, 1, opt=value)
    with pytest.raises(ValueError) as info:
        params.get_as_bool("opt")
    assert str(info.value) == (
        "The rendezvous configuration option 'opt' does not represent a valid boolean value."
    )


def test_get_as_int(api: ModuleType) -> None:
    params = api.RendezvousParameters("c10d", "e", "r", 1, 1, a="12", b=3, c="x", d=None)
    assert params.get_as_int("a") == 12
    assert params.get_as_int("b") == 3
    assert params.get_as_int("d") is None
    assert params.get_as_int("missing", 7) == 7
    assert params.get("missing", "dflt") == "dflt"
    assert params.config == {"a": "12", "b": 3, "c": "x", "d": None}
    with pytest.raises(ValueError) as info:
        params.get_as_int("c")
    assert str(info.value) == (
        "The rendezvous configuration option 'c' does not represent a valid integer value."
    )


def test_parameters_attributes(api: ModuleType) -> None:
    params = api.RendezvousParameters("c10d", "host:1", "run", 2, 4, local_addr="10.0.0.1")
    assert (params.backend, params.endpoint, params.run_id) == ("c10d", "host:1", "run")
    assert (params.min_nodes, params.max_nodes, params.local_addr) == (2, 4, "10.0.0.1")


def test_error_hierarchy(api: ModuleType) -> None:
    for name in (
        "RendezvousClosedError",
        "RendezvousTimeoutError",
        "RendezvousConnectionError",
        "RendezvousStateError",
        "RendezvousGracefulExitError",
    ):
        assert issubclass(getattr(api, name), api.RendezvousError)
    assert issubclass(api.RendezvousError, Exception)


def _handler_class(api: ModuleType, backend: str = "dummy") -> type:
    class Dummy(api.RendezvousHandler):  # type: ignore[name-defined,misc]
        def get_backend(self) -> str:
            return backend

        def next_rendezvous(self) -> Any:
            return None

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return "r"

        def shutdown(self) -> bool:
            return True

    return Dummy


def test_handler_abc(api: ModuleType) -> None:
    assert api.RendezvousHandler.__abstractmethods__ == {
        "get_backend", "next_rendezvous", "is_closed", "set_closed",
        "num_nodes_waiting", "get_run_id", "shutdown",
    }  # fmt: skip
    assert _handler_class(api)().use_agent_store is False
    with pytest.raises(TypeError):
        api.RendezvousHandler()


def test_registry_rules(api: ModuleType) -> None:
    registry = api.RendezvousHandlerRegistry()
    handler_cls = _handler_class(api)

    def creator(params: Any) -> Any:
        return handler_cls()

    def other(params: Any) -> Any:
        return handler_cls()

    registry.register("dummy", creator)
    registry.register("dummy", creator)  # the same creator twice is fine
    kind, message = _message(registry.register, "dummy", other)
    assert kind is ValueError
    assert message == (
        f"The rendezvous backend 'dummy' cannot be registered with '{other}' as it is already "
        f"registered with '{creator}'."
    )
    kind, message = _message(registry.register, "", creator)
    assert (kind, message) == (
        ValueError,
        "The rendezvous backend name must be a non-empty string.",
    )
    params = api.RendezvousParameters("dummy", "e", "r", 1, 1)
    assert isinstance(registry.create_handler(params), handler_cls)
    kind, message = _message(
        registry.create_handler, api.RendezvousParameters("nope", "e", "r", 1, 1)
    )
    assert kind is ValueError
    assert message == (
        "The rendezvous backend 'nope' is not registered. Did you forget to call `register`?"
    )
    registry.register("liar", creator)
    kind, message = _message(
        registry.create_handler, api.RendezvousParameters("liar", "e", "r", 1, 1)
    )
    assert kind is RuntimeError
    assert message == (
        "The rendezvous backend 'dummy' does not match the requested backend 'liar'."
    )


def test_rendezvous_info(api: ModuleType) -> None:
    store_info = api.RendezvousStoreInfo("10.0.0.1", 29500)
    info = api.RendezvousInfo("store", 3, 8, store_info)
    assert (info.store, info.rank, info.world_size) == ("store", 3, 8)
    assert info.bootstrap_store_info.master_addr == "10.0.0.1"
    assert info.bootstrap_store_info.master_port == 29500
    assert api.RendezvousStoreInfo.MASTER_ADDR_KEY == "MASTER_ADDR"


def test_our_info_also_unpacks() -> None:
    store, rank, world = ours.RendezvousInfo("s", 1, 2, None)
    assert (store, rank, world) == ("s", 1, 2)
    assert ours.RendezvousInfo("s", 1, 2)[1] == 1


@pytest.mark.parametrize(
    "endpoint",
    [
        None, "", "  ", "host", "host:1234", "10.0.0.1:80", "[::1]:29400", "[::1]", "::1",
        "host:99999", "host:abc", "host:", "bad host:1", "a.b-c_d:0", "h:0065535",
    ],
)  # fmt: skip
def test_parse_endpoint_matches_torch(endpoint: str | None) -> None:
    def run(fn: Any) -> Any:
        try:
            return fn(endpoint, 29400)
        except ValueError as exc:
            return ("ValueError", str(exc))

    assert run(ours.parse_rendezvous_endpoint) == run(torch_utils.parse_rendezvous_endpoint)


@pytest.mark.parametrize("text", ["", "a=1", " a = 1 , b=x=y ", "a=1,", "=1", "a", "a=,b=2"])
def test_parse_config_matches_torch(text: str) -> None:
    def run(fn: Any) -> Any:
        try:
            return fn(text)
        except ValueError as exc:
            return ("ValueError", str(exc))

    assert run(ours.parse_rendezvous_config) == run(torch_utils._parse_rendezvous_config)


def test_public_surface() -> None:
    for name in ours.__all__:
        assert getattr(ours, name) is not None, name
    assert set(ours.rendezvous_handler_registry.backends()) >= {"c10d", "file", "etcd", "static"}


def test_entry_point_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rdzv_plugin_mod.py").write_text(
        textwrap.dedent(
            """
            from datetime import timedelta

            from rallypoint.rendezvous import StaticRendezvousHandler

            class Plugin(StaticRendezvousHandler):
                def get_backend(self):
                    return "myplugin"

            def create(params):
                return Plugin("127.0.0.1", 1, 0, 1, params.run_id, timedelta(1))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from importlib.metadata import EntryPoint

    from rallypoint.rendezvous import _registry

    entries = [
        EntryPoint("myplugin", "rdzv_plugin_mod:create", _registry.ENTRY_POINT_GROUP),
        EntryPoint("broken", "rdzv_plugin_missing:create", _registry.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(_registry, "entry_points", lambda group: entries)
    registry = _registry.RendezvousHandlerRegistry(entry_point_group=_registry.ENTRY_POINT_GROUP)
    handler = registry.create_handler(ours.RendezvousParameters("myplugin", "", "r", 1, 1))
    assert handler.get_backend() == "myplugin"
    assert "myplugin" in registry.backends()
    with pytest.raises(ValueError, match=r"'broken'.*failed to load"):
        registry.create_handler(ours.RendezvousParameters("broken", "", "r", 1, 1))
