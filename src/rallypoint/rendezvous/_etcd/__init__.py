"""The rendezvous's etcd v3 client: ``gateway`` speaks etcd's JSON gateway over HTTP
(requests, retries, failover, auth, watches) and knows nothing of keys or leases; ``kv``
maps the :class:`~rallypoint.rendezvous._kv.KeyValueStore` interface onto it."""
