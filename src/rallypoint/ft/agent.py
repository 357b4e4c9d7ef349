"""What a launcher calls when a worker of a replica group dies (``rallypoint run`` does):
the other groups are told at once instead of waiting for its heartbeat to stop."""

from rallypoint.ft._notice import tell_gone

__all__ = ["tell_gone"]
