"""Names of the environment variables that rallypoint sets for workers or reads, spelled once.

torchrun's own names (``RANK``, ``TORCHELASTIC_*``...) are torch's contract; rallypoint's
(``RALLYPOINT_*``) are its own. Import the constant instead of writing the string.
"""

from __future__ import annotations

__all__ = [
    "ERROR_FILE",
    "IGNORE_SLURM",
    "PROGRESS_FILE",
    "PROGRESS_SLOT",
    "RESTART_COUNT",
    "RPC_ADDR",
    "RPC_ALLOW_STORE_SECRET",
    "RPC_SECRET",
    "RUN_ID",
    "SIGNALS_TO_HANDLE",
    "STACKS_DIR",
    "STACKS_SIGNAL",
    "USE_AGENT_STORE",
]

# torchelastic's, set by torchrun and by rallypoint run
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
RUN_ID = "TORCHELASTIC_RUN_ID"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""The launcher's ``--signals-to-handle``, comma-separated (torch's launcher sets it)."""

# rallypoint's own
RPC_SECRET = "RALLYPOINT_RPC_SECRET"
"""The job's RPC secret (hex); ``rallypoint run`` sets one per job."""
RPC_ADDR = "RALLYPOINT_RPC_ADDR"
RPC_ALLOW_STORE_SECRET = "RALLYPOINT_RPC_ALLOW_STORE_SECRET"
PROGRESS_FILE = "RALLYPOINT_PROGRESS_FILE"
PROGRESS_SLOT = "RALLYPOINT_PROGRESS_SLOT"
STACKS_DIR = "RALLYPOINT_STACKS_DIR"
STACKS_SIGNAL = "RALLYPOINT_STACKS_SIGNAL"
IGNORE_SLURM = "RALLYPOINT_IGNORE_SLURM"
