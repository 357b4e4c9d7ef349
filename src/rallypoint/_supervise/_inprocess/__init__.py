"""In-process restart, the agent's side: a worker leaves its function and runs it again,
keeping its imports, CUDA context and data, instead of being killed and forked anew. What
runs inside the worker (``@rallypoint.restartable``, the cut, the control channel's
messages) is ``rallypoint._worker_side``, which never imports this.

- ``_agent_side``: the agent's side within one attempt (``rallypoint._supervise._attempt``):
  ``InProcess``, the restart's state machine and the one owner of its timers;
- ``_spares``: spare workers that ran the set-up ahead and take a replaced rank's place.
"""
