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
- :mod:`training_log`: a worker script that trains on gloo and logs each step's time, and
  the calls that wait for every rank to train again after a fault.
"""

from typing import TYPE_CHECKING

from rallypoint._core.public import lazy_face

if TYPE_CHECKING:
    from rallypoint.testing import training_log as training_log
    from rallypoint.testing._etcd import EtcdServer as EtcdServer
    from rallypoint.testing._etcd import TLSFiles as TLSFiles
    from rallypoint.testing._etcd import etcd_binary as etcd_binary
    from rallypoint.testing._etcd import make_tls_files as make_tls_files
    from rallypoint.testing._etcd_cluster import EtcdCluster as EtcdCluster
    from rallypoint.testing._netns import Host as Host
    from rallypoint.testing._netns import NetnsError as NetnsError
    from rallypoint.testing._netns import Network as Network
    from rallypoint.testing._netns import netns_available as netns_available
    from rallypoint.testing._rendezvous_contract import KVContract as KVContract
    from rallypoint.testing._rpc._autograd_contract import (
        run_rpc_autograd_contract as run_rpc_autograd_contract,
    )
    from rallypoint.testing._rpc._contract import run_rpc_contract as run_rpc_contract
    from rallypoint.testing._workers import WorkerError as WorkerError
    from rallypoint.testing._workers import run_workers as run_workers
    from rallypoint.testing._workers import worker_zygote as worker_zygote

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
    "training_log",
    "worker_zygote",
]

_PARTS = ["training_log"]
"""The public submodules, each imported on first access."""
_HOMES = {
    "EtcdCluster": "rallypoint.testing._etcd_cluster",
    "EtcdServer": "rallypoint.testing._etcd",
    "Host": "rallypoint.testing._netns",
    "KVContract": "rallypoint.testing._rendezvous_contract",
    "NetnsError": "rallypoint.testing._netns",
    "Network": "rallypoint.testing._netns",
    "TLSFiles": "rallypoint.testing._etcd",
    "WorkerError": "rallypoint.testing._workers",
    "etcd_binary": "rallypoint.testing._etcd",
    "make_tls_files": "rallypoint.testing._etcd",
    "netns_available": "rallypoint.testing._netns",
    "run_rpc_autograd_contract": "rallypoint.testing._rpc._autograd_contract",
    "run_rpc_contract": "rallypoint.testing._rpc._contract",
    "run_workers": "rallypoint.testing._workers",
    "worker_zygote": "rallypoint.testing._workers",
}
"""Each name's module, imported on first access (PEP 562)."""

lazy_face(__name__)  # its __getattr__ and __dir__ read _HOMES (mypy reads the imports above)
del lazy_face
