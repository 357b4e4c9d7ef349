"""A replica group's state on its way to a healing group: its typed, pickle-free encoding
(``encoding``), rallypoint's authenticated heal stream, the default checkpoint transport
(``heal``), and the readers-writer lock that keeps a state from being read while it
changes (``rwlock``). The manager and ``rallypoint.ft.checkpointing`` import the modules."""
