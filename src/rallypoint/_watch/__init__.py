"""What a node's agent runs to watch its workers: hang stacks, torch's Flight Recorder,
stragglers, and the ``Observer`` that ties them to one node's supervision.

Internal, the launcher side: ``rallypoint._supervise``, ``rallypoint._elastic``,
``rallypoint._launch`` and ``rallypoint._cli`` import its modules directly. The worker's
side of it (the dumpers a worker installs) runs in the worker, set up by
``rallypoint._supervise._worker``. Below it: :mod:`rallypoint.observe` (progress board,
event log).

- ``_observer``: ``Observer``, one node's watch (``WatchOptions``): progress, hangs, stacks,
  Flight Recorder dumps, stragglers, events;
- ``_stacks``: the Python stacks of a worker on request (signal, FIFO), ``_stacks_format``
  their grouping on a screen, ``_stacks_exchange`` asking every node for them (``rallypoint
  stacks``); ``_fifo``: the request pipe;
- ``_flight/``: the Flight Recorder in every worker and the root cause of a hang;
- ``_stragglers/``: the rank or node the others wait for.
"""
