"""The worker side: what runs inside a worker process and talks to its agent only over a
channel. It never imports the agent's code (``_supervise``, ``_elastic``, ``_launch``,
``_watch``, ``_cli``, ``launcher``: a contract in ``pyproject.toml``), so a worker loads
none of it.

- ``_restartable``: ``@rallypoint.restartable``, with the reader of the agent's
  ``Interrupt`` (a thread of the worker's);
- ``_cut``: how an interrupted worker leaves the attempt's connections;
- ``_control``: the control channel's messages, which the agent's side
  (``rallypoint._supervise._inprocess``) imports from here.

Progress reports (``rallypoint.observe._progress``) and the snapshot client
(``rallypoint._snapshot._client``) run in workers too; they live in their own parts, under
the same contract.
"""
