"""torchft's ``torchft._torchft`` names that its tests import: the lighthouse's."""

from rallypoint.ft.coordination import LighthouseClient, LighthouseServer, Quorum, QuorumMember

__all__ = ["LighthouseClient", "LighthouseServer", "Quorum", "QuorumMember"]
