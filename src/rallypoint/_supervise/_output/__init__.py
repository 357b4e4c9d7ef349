"""Worker output: line-prefixed console copy and per-rank log files.

The supervisor reads every worker's stdout and stderr pipe in one thread and writes whole
lines only, so lines of different workers never interleave (``_router``). Files keep the
raw lines under torchrun's layout ``LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK/`` (``_files``);
the console gets them prefixed and fit for a terminal (``rallypoint._core.terminal``,
``_sink``), with a c10d warning's C++ stack folded into one line (``_cpp_stacks``), and the
lines matching torchrun's duplicate filters are also copied to ``filtered_*.log``
(:class:`Duplicate`). A log file that cannot be written never stops the job: the console
copy goes on, and :data:`LOG_TROUBLE` says which directory failed, at most once a minute.
"""

from __future__ import annotations

from rallypoint._supervise._output._console import write_console
from rallypoint._supervise._output._files import LOG_TROUBLE, Duplicate
from rallypoint._supervise._output._router import OutputRouter

__all__ = ["LOG_TROUBLE", "Duplicate", "OutputRouter", "write_console"]
