"""rallypoint's common core: small helpers every part may import, each module imported
directly (``from rallypoint._core.checks import check_int``).

Nothing here but ``torch_c`` imports torch; nothing starts a thread or touches the network
at import time, and nothing here imports another rallypoint package: dependencies point
down to this package, never up from it.

- :mod:`~rallypoint._core.checks`: validation of user input (ints, durations) with messages
  that say what to change;
- :mod:`~rallypoint._core.net`: free ports and port checks;
- :mod:`~rallypoint._core.procs`: process liveness, a process's descendants (``/proc``),
  ending a process without finalization, child subreapers and parent-death signals;
- :mod:`~rallypoint._core.subreaper`: a command run so that nothing it starts outlives it
  (``python -m rallypoint._core.subreaper``);
- :mod:`~rallypoint._core.terminal`: a child's text made fit for a terminal (control
  characters out, lines capped);
- :mod:`~rallypoint._core.envvars`: the names of the environment variables rallypoint sets
  or reads, spelled once;
- :mod:`~rallypoint._core.closing`: the ``with obj:`` protocol for objects with ``close()``;
- :mod:`~rallypoint._core.face`: a public package's face, its names written once;
- :mod:`~rallypoint._core.public`: public names report their public module;
- :mod:`~rallypoint._core.blocking`: a blocking call (a C store call that ignores signals)
  run in a thread, so the caller keeps its own deadline and still handles signals;
- :mod:`~rallypoint._core.forking`: module-level locks that a forked child finds free;
- :mod:`~rallypoint._core.handshake`: the HMAC challenge over a job's secret, and
  ``recv_exact`` under one deadline;
- :mod:`~rallypoint._core.acceptor`: listeners and unauthenticated handshakes on one
  selector thread (the RPC port and the snapshot servers' peer port);
- :mod:`~rallypoint._core.peercred`: whether a Unix socket's peer runs as our uid
  (``SO_PEERCRED``);
- :mod:`~rallypoint._core.cpp_log`: torch's C++ warnings off while a store failure that
  rallypoint handles itself may come (found in the loaded library, never importing torch);
- :mod:`~rallypoint._core.ranks`: a list of ranks in a few characters (``0-3,7``);
- :mod:`~rallypoint._core.store`: ``Store``, the one protocol of a key-value store;
- :mod:`~rallypoint._core.torch_c`: the one module that touches ``torch._C`` (torch's store
  classes, their stubs corrected, and the other private torch names rallypoint uses).
"""
