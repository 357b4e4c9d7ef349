"""Test support: real-process harnesses, fake hosts, real servers and contract suites.

Public names (resolved lazily: importing ``rallypoint.testing`` loads nothing heavy):

- :func:`run_workers` / :class:`WorkerError`: run a function in N processes forked from the
  warm caller, with a launcher-like environment and a deadline; :func:`worker_zygote`
  forks them from a single-threaded copy of the caller instead (for a whole test session).
- :class:`Network` / :class:`Host` / :class:`NetnsError` / :func:`netns_available`: K fake
  hosts in network namespaces (addresses from 198.18.0.0/15), links that can be cut.
- :class:`EtcdServer` / :func:`etcd_binary` / :func:`make_tls_files`: a real etcd server on
  free loopback ports with a temporary data dir (and TLS material for it).
- :class:`EtcdCluster`: several etcd members forming one cluster, on loopback or on fake
  hosts; find, kill, freeze or move the leader, cut a member's link.
- :class:`KVContract`: the behaviour every rendezvous key-value backend must pass (subclass
  it in a pytest module and provide a ``kv`` fixture).
- :func:`run_rpc_contract`: the checks every RPC backend must pass, in fresh processes.
- :func:`run_rpc_autograd_contract`: distributed autograd and ``DistributedOptimizer``
  patterns every RPC backend must pass (gradients against one process, errors, training).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rallypoint._core.lazy import lazy_attributes

_LAZY_NAMES: dict[str, str] = {
    "WorkerError": "rallypoint.testing._workers",
    "run_workers": "rallypoint.testing._workers",
    "worker_zygote": "rallypoint.testing._workers",
    "Host": "rallypoint.testing._netns",
    "NetnsError": "rallypoint.testing._netns",
    "Network": "rallypoint.testing._netns",
    "netns_available": "rallypoint.testing._netns",
    "EtcdServer": "rallypoint.testing._etcd",
    "EtcdCluster": "rallypoint.testing._etcd_cluster",
    "etcd_binary": "rallypoint.testing._etcd",
    "make_tls_files": "rallypoint.testing._etcd",
    "TLSFiles": "rallypoint.testing._etcd",
    "KVContract": "rallypoint.testing._rendezvous_contract",
    "run_rpc_contract": "rallypoint.testing._rpc._contract",
    "run_rpc_autograd_contract": "rallypoint.testing._rpc._autograd_contract",
}

__all__ = [
    "EtcdCluster",
    "EtcdServer",
    "Host",
    "KVContract",
    "NetnsError",
    "Network",
    "TLSFiles",
    "WorkerError",
    "etcd_binary",
    "make_tls_files",
    "netns_available",
    "run_rpc_autograd_contract",
    "run_rpc_contract",
    "run_workers",
    "worker_zygote",
]

if TYPE_CHECKING:
    from rallypoint.testing._etcd import EtcdServer, TLSFiles, etcd_binary, make_tls_files
    from rallypoint.testing._etcd_cluster import EtcdCluster
    from rallypoint.testing._netns import Host, NetnsError, Network, netns_available
    from rallypoint.testing._rendezvous_contract import KVContract
    from rallypoint.testing._rpc._autograd_contract import run_rpc_autograd_contract
    from rallypoint.testing._rpc._contract import run_rpc_contract
    from rallypoint.testing._workers import WorkerError, run_workers, worker_zygote


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY_NAMES, public_home=True)
