"""rallypoint's common core: small helpers every part may import, each module imported
directly (``from rallypoint._core.checks import check_int``).

Nothing here but ``torch_c`` imports torch, nothing starts a thread or touches the network
at import time, and nothing here imports another rallypoint package: dependencies point
down to this package, never up from it.

- input and names: ``checks`` (validation with messages that say what to change),
  ``envvars`` (environment variable names), ``ranks`` (``0-3,7``), ``status`` (how a worker
  and a job ended), ``frames`` (which frames are the user's);
- processes: ``procs`` (liveness, descendants, subreapers, parent-death signals),
  ``subreaper`` (a command that nothing it starts outlives), ``forking`` (locks a forked
  child finds free), ``blocking`` (a blocking call in a thread, keeping the caller's
  deadline and signals), ``tempdirs`` (temporary directories that name their owner
  process; those of dead owners removed);
- network and trust: ``net`` (ports), ``handshake`` (the HMAC challenge over a job's
  secret), ``acceptor`` (listeners and handshakes on one selector thread), ``peercred``;
- output: ``terminal`` (text fit for a terminal), ``throttle``, ``disk``, ``cpp_log``;
- faces and torch: ``face``, ``public``, ``closing``, ``store`` (the ``Store`` protocol),
  ``torch_c`` (the one module that touches ``torch._C``); ``version``.
"""
