"""A replica group's manager machinery that ``rallypoint.ft.manager`` imports: its set-up
(the group store, the member id and key, the heal server, the checks of its arguments), the
thread that asks for its quorums, and the spares of ``WorldSizeMode.FIXED_WITH_SPARES``."""
