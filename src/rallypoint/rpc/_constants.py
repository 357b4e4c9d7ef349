"""Defaults shared with ``torch.distributed.rpc.constants`` (same values).

The environment variables the RPC part reads are named once, in
:mod:`rallypoint._core.envvars` (``RPC_SECRET``, ``RPC_ALLOW_STORE_SECRET``, ``RPC_ADDR``).
"""

from __future__ import annotations

DEFAULT_RPC_TIMEOUT_SEC: float = 60.0
DEFAULT_INIT_METHOD: str = "env://"
DEFAULT_SHUTDOWN_TIMEOUT: float = 0.0
DEFAULT_NUM_WORKER_THREADS: int = 16
UNSET_RPC_TIMEOUT: float = -1.0
