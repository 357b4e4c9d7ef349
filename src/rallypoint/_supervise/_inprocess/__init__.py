"""In-process restart: a worker leaves its function and runs it again, keeping its imports,
CUDA context and data, instead of being killed and forked anew.

- ``_restartable``: ``@rallypoint.restartable``, the worker's side;
- ``_control``: the control channel between the agent and such a worker;
- ``_agent``: the agent's side, within one attempt (``rallypoint._supervise._attempt``).
"""
