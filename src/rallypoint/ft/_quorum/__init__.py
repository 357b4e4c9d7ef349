"""The quorum protocol between replica groups and their lighthouse, told by events:
``records`` (what is written to the store, validated when read), ``client`` (a member's
side: ask, wait on the answer's key, heartbeat), ``decider`` (the lighthouse's decisions,
no I/O) and ``decider_loop`` (its store loop), ``commit`` (one commit decision per
round), ``watch`` (a member's watcher of the lighthouse's news). docs/ft.md."""
