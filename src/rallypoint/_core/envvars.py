"""Names of the environment variables that rallypoint sets for workers or reads, spelled once.

torchrun's own names (``RANK``, ``TORCHELASTIC_*``...) are torch's contract; rallypoint's
(``RALLYPOINT_*``) are its own. Import the constant instead of writing the string.
"""

from __future__ import annotations

__all__ = [
    "AGENT_CPP_LOG_LEVEL",
    "CONTROL_FD",
    "ERROR_FILE",
    "EVENTS_FILE",
    "EVENTS_NODE",
    "FT_NOTICE",
    "IGNORE_SLURM",
    "PROGRESS_FILE",
    "PROGRESS_SLOT",
    "RESTART_COUNT",
    "RPC_ADDR",
    "RPC_ALLOW_STORE_SECRET",
    "RPC_SECRET",
    "RUN_ID",
    "SIGNALS_TO_HANDLE",
    "SNAPSHOT_DIR",
    "SNAPSHOT_EVERY",
    "SNAPSHOT_RESUME_FROM",
    "SNAPSHOT_SOCKET",
    "STACKS_DIR",
    "STACKS_SIGNAL",
    "STANDBY",
    "TORCH_CPP_LOG_LEVEL",
    "USE_AGENT_STORE",
]

# torchelastic's, set by torchrun and by rallypoint run
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
RUN_ID = "TORCHELASTIC_RUN_ID"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""The launcher's ``--signals-to-handle``, comma-separated (torch's launcher sets it)."""

# torch's (c10's), read once when torch is imported
TORCH_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"

# rallypoint's own
RPC_SECRET = "RALLYPOINT_RPC_SECRET"
"""The job's RPC secret (hex); ``rallypoint run`` sets one per job."""
RPC_ADDR = "RALLYPOINT_RPC_ADDR"
RPC_ALLOW_STORE_SECRET = "RALLYPOINT_RPC_ALLOW_STORE_SECRET"
LOCAL_RANK = "RALLYPOINT_LOCAL_RANK"
"""The worker's local rank on its node, as ``LOCAL_RANK`` says unless
``--virtual-local-rank`` makes that 0 for every worker (``rallypoint run`` sets it)."""
PROGRESS_FILE = "RALLYPOINT_PROGRESS_FILE"
PROGRESS_SLOT = "RALLYPOINT_PROGRESS_SLOT"
STACKS_DIR = "RALLYPOINT_STACKS_DIR"
STACKS_SIGNAL = "RALLYPOINT_STACKS_SIGNAL"
IGNORE_SLURM = "RALLYPOINT_IGNORE_SLURM"
CONTROL_FD = "RALLYPOINT_CONTROL_FD"
"""The worker's end of its control channel to the agent (``@rallypoint.restartable``)."""
STANDBY = "RALLYPOINT_STANDBY"
"""Set for a hot spare's workers: they run the set-up, then wait in the restartable
function's wrapper for their ranks (``RANK``, ``WORLD_SIZE``... are not set until then)."""
FT_NOTICE = "RALLYPOINT_FT_NOTICE"
"""A file in the worker's directory where ``rallypoint.ft.Manager`` writes its lighthouse and
member id: if the worker dies, its agent tells the other replica groups at once."""
EVENTS_FILE = "RALLYPOINT_EVENTS_FILE"
"""``--events``: where a worker's library parts append events of their own (``rallypoint.ft``'s
quorum changes and heals), beside the agent's."""
EVENTS_NODE = "RALLYPOINT_EVENTS_NODE"
"""The node name the agent writes in its events, for the workers' events."""
SNAPSHOT_SOCKET = "RALLYPOINT_SNAPSHOT_SOCKET"
"""The Unix socket of this node's snapshot server (``rallypoint run`` sets it)."""
SNAPSHOT_DIR = "RALLYPOINT_SNAPSHOT_DIR"
"""``--snapshot-dir``: where every Kth snapshot is persisted with torch.distributed.checkpoint."""
SNAPSHOT_EVERY = "RALLYPOINT_SNAPSHOT_EVERY"
"""``--snapshot-every``: K."""
SNAPSHOT_RESUME_FROM = "RALLYPOINT_SNAPSHOT_RESUME_FROM"
"""``--snapshot-resume-from``: ``none``, a run id, or an absolute path."""
AGENT_CPP_LOG_LEVEL = "RALLYPOINT_AGENT_CPP_LOG_LEVEL"
"""torch's C++ log level in the agent of a multi-node ``rallypoint run`` (``FATAL`` unless
set: INFO, WARNING, ERROR or FATAL); the workers keep ``TORCH_CPP_LOG_LEVEL``."""
