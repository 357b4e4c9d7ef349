"""Creators of the built-in dynamic handlers (``c10d``, ``file``, ``etcd``) from parameters.

The options every handler reads are listed in ``_config.py``; the backend-specific ones
here (``is_host``, ``store_type``) and in ``_etcd/kv.py``.
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
from rallypoint.rendezvous._config import config_from_params, seconds_option
from rallypoint.rendezvous._dynamic import DynamicRendezvousHandler
from rallypoint.rendezvous._endpoint import matches_machine_hostname, parse_rendezvous_endpoint
from rallypoint.rendezvous._kv import KeyValueStore, KVConnectionError

DEFAULT_PORT = 29400


def _read_timeout(params: RendezvousParameters) -> timedelta:
    timeout = seconds_option(params, "read_timeout", 60.0)
    assert timeout is not None
    return timeout


def _handler(
    kv: KeyValueStore, params: RendezvousParameters, name: str, keep: list[Any]
) -> DynamicRendezvousHandler:
    try:
        config = config_from_params(params)
    except BaseException:  # Ctrl-C too: the store is closed
        kv.close()
        raise
    return DynamicRendezvousHandler(
        kv, config, backend_name=name, keep=keep, hosts_store=bool(keep)
    )


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
    """``etcd``: the etcd v3 API (see ``_etcd/kv.py`` for the options)."""
    from rallypoint.rendezvous._etcd.kv import etcd_kv_from_params

    config_from_params(params)
    kv = etcd_kv_from_params(params)
    return _handler(kv, params, params.backend, [])
