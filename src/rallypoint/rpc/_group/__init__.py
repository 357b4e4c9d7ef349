"""RPC groups in the rendezvous store: :mod:`._groups` (worker records, static and dynamic
groups) and :mod:`._store` (creating the store and waiting on its keys)."""
