"""``rallypoint.rpc.constants``: ``torch.distributed.rpc.constants``' names and values.

The environment variables the RPC part reads are named once, in
:mod:`rallypoint._core.envvars` (``RPC_SECRET``, ``RPC_ALLOW_STORE_SECRET``, ``RPC_ADDR``).
"""

from __future__ import annotations

from datetime import timedelta

DEFAULT_RPC_TIMEOUT_SEC: float = 60.0
DEFAULT_INIT_METHOD: str = "env://"
DEFAULT_SHUTDOWN_TIMEOUT: float = 0.0
DEFAULT_NUM_WORKER_THREADS: int = 16
UNSET_RPC_TIMEOUT: float = -1.0
DEFAULT_PROCESS_GROUP_TIMEOUT: timedelta = timedelta(milliseconds=2**31 - 1)
"""torch's TensorPipe agent waits this long on its process group (rallypoint has none)."""
