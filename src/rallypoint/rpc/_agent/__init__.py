"""The RALLYPOINT backend's agent: the one place that ties transport, group, RRefs and
distributed autograd together.

:mod:`._agent` (the agent), :mod:`._membership` (joining, leaving, the shutdown barrier),
:mod:`._connections` (the listener and the sockets), :mod:`._dispatch` (frames in),
:mod:`._codec` (messages for a peer), :mod:`._calls` (calls awaiting a reply),
:mod:`._peers` (names, ranks, device maps, dead peers) and :mod:`._liveness` (probes).
"""
