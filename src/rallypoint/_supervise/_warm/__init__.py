"""The warm process: a process that has imported torch once and forks every worker.

- ``_process``: the supervisor's handle on it (:class:`WarmProcess`): start, fork workers,
  run the store, stop;
- ``_server``: its own side, the loop that answers those commands;
- ``_messages``: the pickled dataclasses between the two;
- ``_fork_probe``: whether torch's OpenMP threads survive a fork from it;
- ``_snapshots``: the node's snapshot server, which it forks.
"""
