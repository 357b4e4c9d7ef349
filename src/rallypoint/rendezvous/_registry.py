"""The backend registry: name -> creator, with built-ins and entry-point plugins.

Same rules as torch's ``RendezvousHandlerRegistry``: registering the same creator twice is
fine, a different creator under a taken name raises ``ValueError`` naming both, an unknown
backend raises ``ValueError``, and a handler whose ``get_backend()`` differs from the name
it was created under raises ``RuntimeError``. Third-party backends are found through the
entry-point group ``rallypoint.rendezvous_backends``: an entry ``name = "pkg.mod:creator"``
whose object is a ``creator(params) -> RendezvousHandler``; it is loaded only when a
handler of that name is first asked for.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from rallypoint.rendezvous._api import (
    RendezvousHandler,
    RendezvousHandlerCreator,
    RendezvousParameters,
)

logger = logging.getLogger("rallypoint.rendezvous")

ENTRY_POINT_GROUP = "rallypoint.rendezvous_backends"


class RendezvousHandlerRegistry:
    """Maps a backend name to the creator of its :class:`RendezvousHandler`."""

    def __init__(self, *, entry_point_group: str | None = None) -> None:
        self._registry: dict[str, RendezvousHandlerCreator] = {}
        self._group = entry_point_group

    def register(self, backend: str, creator: RendezvousHandlerCreator) -> None:
        """Register ``creator`` under ``backend``."""
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        current = self._registry.get(backend)
        if current is not None and current != creator:
            raise ValueError(
                f"The rendezvous backend '{backend}' cannot be registered with '{creator}' as it "
                f"is already registered with '{current}'."
            )
        self._registry[backend] = creator

    def backends(self) -> list[str]:
        """The registered names (plugins appear once loaded)."""
        return sorted(self._registry)

    def available(self) -> list[str]:
        """The names :meth:`create_handler` takes: the registered ones and those of the
        installed plugins (their entry points are listed, not loaded)."""
        names = set(self._registry)
        if self._group is not None:
            names.update(entry.name for entry in entry_points(group=self._group))
        return sorted(names)

    def is_available(self, backend: str) -> bool:
        """Whether :meth:`create_handler` knows ``backend`` (a plugin is not loaded)."""
        return backend in self._registry or backend in self.available()

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """Create the handler ``params.backend`` names."""
        creator = self._registry.get(params.backend)
        if creator is None and self._group is not None:
            creator = self._load_plugin(params.backend)
        if creator is None:
            raise ValueError(
                f"The rendezvous backend '{params.backend}' is not registered. Did you forget "
                f"to call `{self.register.__name__}`?"
            )
        handler = creator(params)
        if handler.get_backend() != params.backend:
            raise RuntimeError(
                f"The rendezvous backend '{handler.get_backend()}' does not match the requested "
                f"backend '{params.backend}'."
            )
        return handler

    def _load_plugin(self, name: str) -> RendezvousHandlerCreator | None:
        assert self._group is not None
        for entry in entry_points(group=self._group):
            if entry.name != name:
                continue
            try:
                creator = entry.load()
            except Exception as exc:
                raise ValueError(
                    f"The rendezvous backend '{name}' (entry point {entry.value!r} in group "
                    f"'{self._group}') failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            if not callable(creator):
                raise ValueError(
                    f"The entry point {entry.value!r} for rendezvous backend '{name}' is not "
                    "callable; it must name a creator(params) -> RendezvousHandler."
                )
            self.register(name, creator)
            return creator  # type: ignore[no-any-return]
        return None


def _create_c10d(params: RendezvousParameters) -> RendezvousHandler:
    from rallypoint.rendezvous._backends import create_c10d_handler

    return create_c10d_handler(params)


def _create_file(params: RendezvousParameters) -> RendezvousHandler:
    from rallypoint.rendezvous._backends import create_file_handler

    return create_file_handler(params)


def _create_etcd(params: RendezvousParameters) -> RendezvousHandler:
    from rallypoint.rendezvous._backends import create_etcd_handler

    return create_etcd_handler(params)


def _create_static(params: RendezvousParameters) -> RendezvousHandler:
    from rallypoint.rendezvous._static import create_static_handler

    return create_static_handler(params)


rendezvous_handler_registry = RendezvousHandlerRegistry(entry_point_group=ENTRY_POINT_GROUP)
rendezvous_handler_registry.register("c10d", _create_c10d)
rendezvous_handler_registry.register("file", _create_file)
rendezvous_handler_registry.register("etcd", _create_etcd)
rendezvous_handler_registry.register("etcd-v3", _create_etcd)
rendezvous_handler_registry.register("static", _create_static)


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create a handler from the global registry (torch's ``get_rendezvous_handler``)."""
    return rendezvous_handler_registry.create_handler(params)
