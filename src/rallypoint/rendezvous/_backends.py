"""Creators of the built-in dynamic handlers (``c10d``, ``file``, ``etcd``) from parameters.

Options (``RendezvousParameters`` keyword arguments, or ``--rdzv-conf k=v,...``), the same
names torch reads plus a few of ours:

=======================  ================================================================
``join_timeout``         seconds a round may take (600)
``last_call_timeout``    seconds to wait for more nodes once ``min_nodes`` joined (30)
``close_timeout``        seconds for closing (30)
``keep_alive_interval``  seconds between heartbeats (5)
``keep_alive_max_attempt``  missed heartbeats before a node is presumed dead (3)
``read_timeout``         seconds a store operation / connection may take (60)
``is_host``              c10d: whether this node hosts the TCPStore (default: the endpoint
                         names this machine)
``store_type``           c10d: ``tcp`` (default) or ``file``
``use_agent_store``      rank 0 hosts a TCPStore for the workers (true)
=======================  ================================================================

Durations accept fractions of a second (``last_call_timeout=0.5``); torch accepts integers.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from typing import Any

from rallypoint.rendezvous._api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
)
from rallypoint.rendezvous._dynamic import DynamicRendezvousConfig, DynamicRendezvousHandler
from rallypoint.rendezvous._endpoint import matches_machine_hostname, parse_rendezvous_endpoint
from rallypoint.rendezvous._kv import KeyValueStore, KVConnectionError

DEFAULT_PORT = 29400


def get_seconds(params: RendezvousParameters, key: str, default: float | None) -> float | None:
    """Read a duration option in seconds (int, float, numeric string or timedelta)."""
    value = params.get(key, default)
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    try:
        seconds = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"The rendezvous configuration option '{key}' does not represent a valid number of "
            "seconds."
        ) from exc
    if seconds <= 0:
        raise ValueError(
            f"The rendezvous configuration option '{key}' must be a positive number of seconds, "
            f"got {value!r}."
        )
    return seconds


def config_from_params(params: RendezvousParameters) -> DynamicRendezvousConfig:
    """The handler settings the parameters describe (``ValueError`` names a bad option)."""
    timeouts: dict[str, Any] = {}
    for name in ("join", "last_call", "close"):
        seconds = get_seconds(params, f"{name}_timeout", None)
        if seconds is not None:
            timeouts[f"{name}_timeout"] = timedelta(seconds=seconds)
    if "keep_alive_interval" in params.config and params.get("keep_alive_interval") is None:
        raise TypeError(
            "You passed 'keep_alive_interval=None' as a rendezvous configuration option"
        )
    if "keep_alive_max_attempt" in params.config and params.get("keep_alive_max_attempt") is None:
        raise TypeError(
            "You passed 'keep_alive_max_attempt=None' as a rendezvous configuration option"
        )
    interval = get_seconds(params, "keep_alive_interval", 5.0)
    attempts = params.get_as_int("keep_alive_max_attempt", 3)
    agent_store = params.get_as_bool("use_agent_store", True)
    assert interval is not None and attempts is not None and agent_store is not None
    return DynamicRendezvousConfig(
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        keep_alive_interval=timedelta(seconds=interval),
        keep_alive_max_attempt=attempts,
        local_addr=params.local_addr,
        use_agent_store=agent_store,
        **timeouts,
    )


def _read_timeout(params: RendezvousParameters) -> timedelta:
    seconds = get_seconds(params, "read_timeout", 60.0)
    assert seconds is not None
    return timedelta(seconds=seconds)


def _handler(
    kv: KeyValueStore, params: RendezvousParameters, name: str, keep: list[Any]
) -> DynamicRendezvousHandler:
    try:
        config = config_from_params(params)
    except BaseException:
        kv.close()
        raise
    return DynamicRendezvousHandler(kv, config, backend_name=name, keep=keep)


def _tcp(params: RendezvousParameters) -> tuple[KeyValueStore, list[Any]]:
    from rallypoint.rendezvous._kv_c10d import tcp_kv

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    explicit = params.get_as_bool("is_host")
    is_host = explicit if explicit is not None else matches_machine_hostname(host)
    timeout = _read_timeout(params)
    for as_server in [True, False] if is_host and explicit is None else [is_host]:
        try:
            kv, server = tcp_kv(host, port, is_server=as_server, timeout=timeout)
        except KVConnectionError as exc:
            if as_server and explicit is None:
                continue  # another node on this machine hosts it: connect as a client
            raise RendezvousConnectionError(str(exc)) from exc
        return kv, [server] if server is not None else []
    raise AssertionError("unreachable")


def _file(params: RendezvousParameters) -> KeyValueStore:
    from rallypoint.rendezvous._kv_c10d import file_kv

    path = params.endpoint.strip() if params.endpoint else ""
    if not path:
        try:
            _, path = tempfile.mkstemp(prefix="rallypoint-rdzv-")
        except OSError as exc:
            raise RendezvousError(
                f"Cannot create a temporary file for the file store: {exc}"
            ) from exc
    try:
        return file_kv(path)
    except KVConnectionError as exc:
        raise RendezvousConnectionError(str(exc)) from exc


def create_c10d_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """``c10d``: a TCPStore (hosted by the node the endpoint names) or, with
    ``store_type=file``, a FileStore at the endpoint path."""
    store_type = str(params.get("store_type", "tcp")).strip().lower()
    if store_type == "tcp":
        _read_timeout(params)  # validate before connecting
        config_from_params(params)
        kv, keep = _tcp(params)
        return _handler(kv, params, "c10d", keep)
    if store_type == "file":
        config_from_params(params)
        return _handler(_file(params), params, "c10d", [])
    raise ValueError("Invalid store type given. Currently only supports file and tcp.")


def create_file_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """``file``: a FileStore at the path in ``endpoint`` (shared by every node)."""
    config_from_params(params)
    return _handler(_file(params), params, params.backend, [])


def create_etcd_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """``etcd``: the etcd v3 API (see ``_kv_etcd.py`` for the options)."""
    from rallypoint.rendezvous._kv_etcd import etcd_kv_from_params

    config_from_params(params)
    kv = etcd_kv_from_params(params)
    return _handler(kv, params, params.backend, [])
