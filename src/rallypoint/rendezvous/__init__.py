"""Who is in the job: torchelastic's rendezvous API, a scalable dynamic handler, backends.

Drop-in for ``torch.distributed.elastic.rendezvous``: the same errors, ``RendezvousHandler``,
``RendezvousInfo`` (which also unpacks as ``store, rank, world_size``),
``RendezvousParameters`` and registry rules. Backends (``rendezvous_handler_registry``):

- ``c10d`` (default): a TCPStore hosted by the node the endpoint names;
- ``file``: a FileStore on a shared path;
- ``etcd`` (alias ``etcd-v3``): the etcd v3 API over its HTTP gateway (TLS, auth, leases);
- ``static``: fixed ranks from the parameters;
- plugins from the entry-point group ``rallypoint.rendezvous_backends``.

Every dynamic backend implements one small :class:`KeyValueStore`; the handler does O(1)
store round trips per node per round (see ``_dynamic.py``). Modules, bottom up: ``_api``
(errors, handler ABC), ``_kv`` (the interface) and one ``_kv_*`` per store (etcd's in the
``_etcd`` package: ``kv`` over its HTTP side, ``gateway``), ``_config`` (settings and
options), ``_rounds`` (key layout, records, rank assignment), ``_background`` (the
handler's thread), ``_dynamic`` (the handler), ``_backends``/``_static`` (creators),
``_registry``.
"""

from rallypoint._core.public import set_public_module
from rallypoint.rendezvous._api import RendezvousClosedError as RendezvousClosedError
from rallypoint.rendezvous._api import RendezvousConnectionError as RendezvousConnectionError
from rallypoint.rendezvous._api import RendezvousError as RendezvousError
from rallypoint.rendezvous._api import (
    RendezvousGracefulExitError as RendezvousGracefulExitError,
)
from rallypoint.rendezvous._api import RendezvousHandler as RendezvousHandler
from rallypoint.rendezvous._api import RendezvousHandlerCreator as RendezvousHandlerCreator
from rallypoint.rendezvous._api import RendezvousInfo as RendezvousInfo
from rallypoint.rendezvous._api import RendezvousParameters as RendezvousParameters
from rallypoint.rendezvous._api import RendezvousStateError as RendezvousStateError
from rallypoint.rendezvous._api import RendezvousStoreInfo as RendezvousStoreInfo
from rallypoint.rendezvous._api import RendezvousTimeoutError as RendezvousTimeoutError
from rallypoint.rendezvous._config import DynamicRendezvousConfig as DynamicRendezvousConfig
from rallypoint.rendezvous._dynamic import DynamicRendezvousHandler as DynamicRendezvousHandler
from rallypoint.rendezvous._endpoint import parse_rendezvous_config as parse_rendezvous_config
from rallypoint.rendezvous._endpoint import (
    parse_rendezvous_endpoint as parse_rendezvous_endpoint,
)
from rallypoint.rendezvous._kv import KeyValueStore as KeyValueStore
from rallypoint.rendezvous._kv import KVConnectionError as KVConnectionError
from rallypoint.rendezvous._kv import KVError as KVError
from rallypoint.rendezvous._kv import KVStateError as KVStateError
from rallypoint.rendezvous._kv_memory import MemoryKV as MemoryKV
from rallypoint.rendezvous._kv_url import connect_kv as connect_kv
from rallypoint.rendezvous._kv_url import is_etcd_address as is_etcd_address
from rallypoint.rendezvous._registry import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from rallypoint.rendezvous._registry import (
    RendezvousHandlerRegistry as RendezvousHandlerRegistry,
)
from rallypoint.rendezvous._registry import get_rendezvous_handler as get_rendezvous_handler
from rallypoint.rendezvous._registry import (
    rendezvous_handler_registry as rendezvous_handler_registry,
)
from rallypoint.rendezvous._static import StaticRendezvousHandler as StaticRendezvousHandler

__all__ = [
    "ENTRY_POINT_GROUP",
    "DynamicRendezvousConfig",
    "DynamicRendezvousHandler",
    "KVConnectionError",
    "KVError",
    "KVStateError",
    "KeyValueStore",
    "MemoryKV",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeoutError",
    "StaticRendezvousHandler",
    "connect_kv",
    "get_rendezvous_handler",
    "is_etcd_address",
    "parse_rendezvous_config",
    "parse_rendezvous_endpoint",
    "rendezvous_handler_registry",
]

set_public_module(__name__, globals(), __all__)  # the one place: __module__ is this face
del set_public_module
